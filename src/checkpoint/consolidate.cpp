#include "checkpoint/consolidate.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <sstream>
#include <vector>

#include "core/error.h"
#include "core/fsutil.h"
#include "core/progress.h"
#include "core/sha256.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/flat_shards.h"
#include "checkpoint/model_tensors.h"

namespace dtrain {

namespace stdfs = std::filesystem;

namespace {

// The files a consolidated model directory holds, in order; model.safetensors is required.
const char* const kFiles[] = {"model.safetensors", "config.json",    "vocab.json",
                              "merges.txt",        "tokenizer.json", "tokenizer_config.json"};

// SHA256SUMS of a verified checkpoint: file name -> hex digest.
std::map<std::string, std::string> read_sums(const std::string& ck) {
  std::map<std::string, std::string> out;
  std::istringstream in(fs::read_file(ck + "/SHA256SUMS"));
  std::string line;
  while (std::getline(in, line))
    if (line.size() > 66) out[line.substr(66)] = line.substr(0, 64);
  return out;
}

// Copies `src` to `dst` in 4 MiB chunks and returns the SHA-256 of what was written, in one pass
// (the copy is checked against SHA256SUMS without reading it back); each chunk counts in `progress`.
std::string copy_hashed(const std::string& src, const std::string& dst, Progress& progress) {
  struct Closer {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };
  std::unique_ptr<std::FILE, Closer> in(std::fopen(src.c_str(), "rb"));
  if (!in) fault("cannot read {}", src);
  std::unique_ptr<std::FILE, Closer> out(std::fopen(dst.c_str(), "wb"));
  if (!out) fault("cannot write {}", dst);
  std::vector<char> buf(size_t(4) << 20);
  Sha256 h;
  for (;;) {
    const size_t n = std::fread(buf.data(), 1, buf.size(), in.get());
    if (n > 0) {
      h.update(buf.data(), n);
      if (std::fwrite(buf.data(), 1, n, out.get()) != n) fault("cannot write {} (disk full?)", dst);
      progress.add(int64_t(n));
    }
    if (n < buf.size()) break;
  }
  if (std::ferror(in.get())) fault("cannot read {}", src);
  if (std::fflush(out.get()) != 0) fault("cannot write {} (disk full?)", dst);
  return h.hex();
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
  // ZeRO-3: the ranks' model shards, put together here; else the one model file, copied
  bool sharded = false;
  for (const auto& [name, hex] : sums) {
    int i = 0, n = 0;
    sharded = sharded || parse_flat_shard_name(FlatKind::Model, name, &i, &n);
  }
  if (!sharded && !sums.count(kFiles[0]))
    user_error("checkpoint {}: no model.safetensors listed in SHA256SUMS", r.checkpoint);
  ModelTensors model(sharded ? r.checkpoint : r.checkpoint + "/" + kFiles[0]);  // validated: header, shards
  r.tensors = int64_t(model.names().size());

  const stdfs::path out = stdfs::path(r.out).lexically_normal();
  const std::string parent = out.has_parent_path() ? out.parent_path().string() : ".";
  fs::mkdirs(parent);
  const std::string tmp = (stdfs::path(parent) / (".tmp-" + out.filename().string() + "-" + std::to_string(::getpid()))).string();
  fs::remove_tree(tmp);
  fs::mkdirs(tmp);
  int64_t total = 0;
  for (const char* f : kFiles)
    if (sums.count(f)) total += int64_t(stdfs::file_size(r.checkpoint + "/" + f));
  if (sharded)
    for (const std::string& n : model.names()) total += int64_t(model.nbytes(n));
  Progress progress("consolidate " + r.checkpoint, total, "bytes");  // a line on a terminal, or every 10 s
  try {
    if (sharded) {
      // every tensor read from the shards' ranges, in PyTorch's names, shapes and layouts
      std::vector<ParamStore::Exported> ex;
      for (const std::string& n : model.names()) {
        ParamStore::Exported x{n, model.dtype(n), model.shape(n), std::vector<uint8_t>(model.nbytes(n))};
        model.read(n, x.bytes.data(), x.bytes.size());
        progress.add(int64_t(x.bytes.size()));
        ex.push_back(std::move(x));
      }
      const std::string step = std::to_string(model.shards()->step());
      write_exported(tmp + "/" + kFiles[0], ex, {{"format", "pt"}, {"producer", "dtrain " DTRAIN_VERSION}, {"step", step}});
      r.files.emplace_back(kFiles[0]);
      r.bytes += int64_t(stdfs::file_size(tmp + "/" + kFiles[0]));
    }
    for (const char* f : kFiles) {
      const auto it = sums.find(f);
      if (it == sums.end()) continue;
      const std::string dst = tmp + "/" + f;
      if (copy_hashed(r.checkpoint + "/" + f, dst, progress) != it->second)
        fault("{}: the copy of {}/{} does not match its SHA256SUMS entry", dst, r.checkpoint, f);
      fs::fsync_path(dst);
      r.files.emplace_back(f);
      r.bytes += int64_t(stdfs::file_size(dst));
    }
    fs::fsync_dir(tmp);
    if (stdfs::exists(r.out)) stdfs::remove(r.out);  // the empty directory checked above
    fs::rename_path(tmp, r.out);
    fs::fsync_dir(parent);
    progress.finish();
  } catch (...) {
    fs::remove_tree(tmp);
    throw;
  }
  return r;
}

}  // namespace dtrain
