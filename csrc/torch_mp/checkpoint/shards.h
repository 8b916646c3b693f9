#pragma once
// The checkpoint format, below modules and optimizers: tensors named as in the dense model, each
// rank writing its own parts of them, read back into any other cut.
//
// A checkpoint is a directory:
//
//   index.json                  written last: the format, the list of shard files, metadata
//   shard-<pp>-<tp>.safetensors one per rank of data rank 0: its parts of the tensors it holds
//
// A tensor sharded along a dim is stored as the blocks of the dense tensor that this rank holds,
// each under "<name>@<dim>:<first dense index>" (a fused Q/K/V weight as three blocks, a padded
// vocabulary without its padding); a whole tensor under its name, written by one rank of the
// group it is replicated over. Each file's metadata gives every name's dense shape. Loading
// reads only the blocks that overlap what this rank holds, so any (tp, pp, dp) can read what
// any other wrote, and a dense safetensors file loads the same way (each tensor one block).
//
// One header per idea, all included here:
//
//   shard_geometry.h  which blocks of which dense tensors a rank holds (Shard, shard_of)
//   shard_writer.h    save: each rank its shard file, rank 0 the index, published at once
//   shard_reader.h    Reader: the blocks that overlap what a rank holds; consolidate
//   async_save.h      save in the background, from a snapshot
//   verify.h          a whole checkpoint checked against its checksums (checksum.h: CRC-32C)
//   (../agreement.h   a problem on one rank raised on every rank: collect_problems)
//   index.h           index.json;   atomic_files.h: the temporary directory and its renames

#include "torch_mp/agreement.h"                  // IWYU pragma: export
#include "torch_mp/checkpoint/async_save.h"      // IWYU pragma: export
#include "torch_mp/checkpoint/safetensors.h"     // IWYU pragma: export
#include "torch_mp/checkpoint/shard_geometry.h"  // IWYU pragma: export
#include "torch_mp/checkpoint/shard_reader.h"    // IWYU pragma: export
#include "torch_mp/checkpoint/shard_writer.h"    // IWYU pragma: export
#include "torch_mp/checkpoint/verify.h"          // IWYU pragma: export
