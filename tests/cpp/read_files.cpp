// The C++ front end's verdict on files from elsewhere, for tests/python/test_untrusted_files.py:
// for each argument, a safetensors file read whole (torch_mp::checkpoint::load_file) or a
// checkpoint directory opened (its index and every file's header: checkpoint::Reader), one
// line each, flushed before the next is read (so that a crash names its file):
//
//   <path>\tok
//   <path>\trefused\t<the error's first line>

#include <c10/util/Exception.h>

#include <filesystem>
#include <iostream>
#include <string>

#include "torch_mp/checkpoint/safetensors.h"
#include "torch_mp/checkpoint/shard_reader.h"

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string path = argv[i];
    try {
      if (std::filesystem::is_directory(path)) {
        torch_mp::checkpoint::Reader(path, nullptr);
      } else {
        torch_mp::checkpoint::load_file(path);
      }
      std::cout << path << "\tok" << std::endl;
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      std::cout << path << "\trefused\t" << message.substr(0, message.find('\n')) << std::endl;
    }
  }
  return 0;
}
