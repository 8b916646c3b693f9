#pragma once
// torch_mp for LibTorch applications: include this one header and link torch_mp::torch_mp.

#include "torch_mp/agreement.h"                            // IWYU pragma: export
#include "torch_mp/checkpoint/checkpoint.h"                // IWYU pragma: export
#include "torch_mp/checkpoint/safetensors.h"               // IWYU pragma: export
#include "torch_mp/clip_grad.h"                            // IWYU pragma: export
#include "torch_mp/collectives.h"                          // IWYU pragma: export
#include "torch_mp/comm.h"                                 // IWYU pragma: export
#include "torch_mp/data_parallel/data_parallel.h"          // IWYU pragma: export
#include "torch_mp/data_parallel/gradient_sync.h"          // IWYU pragma: export
#include "torch_mp/data_parallel/shard_layout.h"           // IWYU pragma: export
#include "torch_mp/data_parallel/sharded_gradient_sync.h"  // IWYU pragma: export
#include "torch_mp/dense.h"                                // IWYU pragma: export
#include "torch_mp/grad_scaler.h"                          // IWYU pragma: export
#include "torch_mp/layout.h"                               // IWYU pragma: export
#include "torch_mp/mesh.h"                                 // IWYU pragma: export
#include "torch_mp/optim/distributed_optimizer.h"          // IWYU pragma: export
#include "torch_mp/optim/parameter_shards.h"               // IWYU pragma: export
#include "torch_mp/pipeline/executor.h"                    // IWYU pragma: export
#include "torch_mp/pipeline/partition.h"                   // IWYU pragma: export
#include "torch_mp/pipeline/pipeline.h"                    // IWYU pragma: export
#include "torch_mp/pipeline/schedule.h"                    // IWYU pragma: export
#include "torch_mp/pipeline/simulate.h"                    // IWYU pragma: export
#include "torch_mp/process_groups.h"                       // IWYU pragma: export
#include "torch_mp/recompute.h"                            // IWYU pragma: export
#include "torch_mp/tensor_parallel/attention.h"            // IWYU pragma: export
#include "torch_mp/tensor_parallel/conv.h"                 // IWYU pragma: export
#include "torch_mp/tensor_parallel/conv_block.h"           // IWYU pragma: export
#include "torch_mp/tensor_parallel/cross_entropy.h"        // IWYU pragma: export
#include "torch_mp/tensor_parallel/embedding.h"            // IWYU pragma: export
#include "torch_mp/tensor_parallel/layer_norm.h"           // IWYU pragma: export
#include "torch_mp/tensor_parallel/linear.h"               // IWYU pragma: export
#include "torch_mp/tensor_parallel/mlp.h"                  // IWYU pragma: export
#include "torch_mp/tensor_parallel/random.h"               // IWYU pragma: export
#include "torch_mp/tensor_parallel/sharding.h"             // IWYU pragma: export
#include "torch_mp/tensor_parallel/transformer_layer.h"    // IWYU pragma: export
