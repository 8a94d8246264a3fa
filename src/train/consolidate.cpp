#include "train/consolidate.h"

#include <unistd.h>

#include <filesystem>
#include <map>
#include <sstream>

#include "core/error.h"
#include "core/fsutil.h"
#include "core/sha256.h"
#include "train/checkpoint.h"
#include "train/safetensors.h"

namespace dtrain {

namespace stdfs = std::filesystem;

namespace {

// The files a consolidated model directory holds, in order; model.safetensors is required.
const char* const kFiles[] = {"model.safetensors", "config.json", "vocab.json", "merges.txt"};

// SHA256SUMS of a verified checkpoint: file name -> hex digest.
std::map<std::string, std::string> read_sums(const std::string& ck) {
  std::map<std::string, std::string> out;
  std::istringstream in(fs::read_file(ck + "/SHA256SUMS"));
  std::string line;
  while (std::getline(in, line))
    if (line.size() > 66) out[line.substr(66)] = line.substr(0, 64);
  return out;
}

}  // namespace

std::string default_consolidated_dir(const std::string& checkpoint_dir) {
  const stdfs::path ck = stdfs::path(checkpoint_dir).lexically_normal();
  const stdfs::path name = ck.has_filename() ? ck.filename() : ck.parent_path().filename();
  const stdfs::path parent = ck.has_filename() ? ck.parent_path() : ck.parent_path().parent_path();
  if (parent.filename() == "checkpoints" && CheckpointManager::step_of(name.string()) >= 0)
    return (parent.parent_path() / "consolidated" / name).string();
  return (parent / (name.string() + "-consolidated")).string();
}

ConsolidatedModel consolidate_checkpoint(const std::string& path, const std::string& out_arg) {
  ConsolidatedModel r;
  r.checkpoint = resolve_checkpoint_dir(path);  // verified (every file against SHA256SUMS)
  r.out = out_arg.empty() ? default_consolidated_dir(r.checkpoint) : out_arg;
  if (stdfs::exists(r.out) && !(stdfs::is_directory(r.out) && stdfs::is_empty(r.out)))
    user_error("--out {}: exists and is not an empty directory (consolidate writes a new model directory)", r.out);
  const std::map<std::string, std::string> sums = read_sums(r.checkpoint);
  if (!sums.count(kFiles[0]))
    user_error("checkpoint {}: no model.safetensors listed in SHA256SUMS", r.checkpoint);
  const SafetensorsReader model(r.checkpoint + "/" + kFiles[0]);  // a readable safetensors header
  r.tensors = int64_t(model.names().size());

  const stdfs::path out = stdfs::path(r.out).lexically_normal();
  const std::string parent = out.has_parent_path() ? out.parent_path().string() : ".";
  fs::mkdirs(parent);
  const std::string tmp = (stdfs::path(parent) / (".tmp-" + out.filename().string() + "-" + std::to_string(::getpid()))).string();
  fs::remove_tree(tmp);
  fs::mkdirs(tmp);
  try {
    for (const char* f : kFiles) {
      const auto it = sums.find(f);
      if (it == sums.end()) continue;
      const std::string dst = tmp + "/" + f;
      std::error_code ec;
      stdfs::copy_file(r.checkpoint + "/" + f, dst, ec);
      if (ec) fault("cannot copy {}/{} to {}: {}", r.checkpoint, f, dst, ec.message());
      if (sha256_file(dst) != it->second)
        fault("{}: the copy of {}/{} does not match its SHA256SUMS entry", dst, r.checkpoint, f);
      fs::fsync_path(dst);
      r.files.emplace_back(f);
      r.bytes += int64_t(stdfs::file_size(dst));
    }
    fs::fsync_dir(tmp);
    if (stdfs::exists(r.out)) stdfs::remove(r.out);  // the empty directory checked above
    fs::rename_path(tmp, r.out);
    fs::fsync_dir(parent);
  } catch (...) {
    fs::remove_tree(tmp);
    throw;
  }
  return r;
}

}  // namespace dtrain
