#include "data/manifest.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/log.h"
#include "core/sha256.h"

namespace dtrain::data {

namespace fs = std::filesystem;
using nlohmann::json;

std::string dataset_not_found_message(const std::string& root) {
  std::error_code ec;
  if (fs::is_directory(root, ec)) {  // WebDataset shards from another tool: index them
    for (fs::recursive_directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
      if (it.depth() > 1) it.disable_recursion_pending();
      if (it->is_regular_file(ec) && it->path().extension() == ".tar")
        return fmt::format("{}: no manifest.json (index its .tar shards with: dtrain data index {})", root, root);
    }
  }
  std::string name = fs::path(root).lexically_normal().filename().string();
  if (name.empty()) name = fs::path(root).lexically_normal().parent_path().filename().string();
  if (name.find("fashion-mnist") != std::string::npos || name.find("fashion_mnist") != std::string::npos)
    return fmt::format("{}: dataset not found (create it with: dtrain data fashion-mnist --out {})", root, root);
  return fmt::format("{}: dataset not found (create it with: dtrain data images SRC_DIR --out {})", root, root);
}

namespace {

int64_t get_int(const json& j, const char* key, const std::string& where, int64_t min_value) {
  if (!j.contains(key)) user_error("{}: missing key '{}'", where, key);
  const json& v = j.at(key);
  if (!v.is_number_integer()) user_error("{}: '{}' must be an integer, got {}", where, key, v.dump());
  int64_t x = v.get<int64_t>();
  if (x < min_value) user_error("{}: '{}' must be >= {}, got {}", where, key, min_value, x);
  return x;
}

std::string get_str(const json& j, const char* key, const std::string& where) {
  if (!j.contains(key)) user_error("{}: missing key '{}'", where, key);
  const json& v = j.at(key);
  if (!v.is_string()) user_error("{}: '{}' must be a string, got {}", where, key, v.dump());
  return v.get<std::string>();
}

bool is_sha256_hex(const std::string& s) {
  if (s.size() != 64) return false;
  for (char c : s)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

}  // namespace

Manifest read_manifest(const std::string& root) {
  std::error_code ec;
  fs::path mpath = fs::path(root) / "manifest.json";
  if (!fs::is_directory(root, ec) || !fs::exists(mpath, ec)) user_error("{}", dataset_not_found_message(root));
  std::string where = mpath.string();
  std::ifstream in(mpath, std::ios::binary);
  if (!in) fault("cannot read {}", where);
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    user_error("{}: not valid JSON ({})", where, e.what());
  }
  if (!j.is_object()) user_error("{}: expected a JSON object", where);
  std::string format = get_str(j, "format", where);
  if (format != kManifestFormat) user_error("{}: format '{}' is not '{}'", where, format, kManifestFormat);
  int64_t version = get_int(j, "version", where, 0);
  if (version != kManifestVersion)
    user_error("{}: version {} is not supported (this dtrain reads version {})", where, version, kManifestVersion);
  Manifest m;
  if (j.contains("classes")) {
    const json& c = j.at("classes");
    if (!c.is_array()) user_error("{}: 'classes' must be an array of strings", where);
    for (const json& x : c) {
      if (!x.is_string()) user_error("{}: 'classes' must be an array of strings, found {}", where, x.dump());
      m.classes.push_back(x.get<std::string>());
    }
  }
  if (!j.contains("splits") || !j.at("splits").is_object()) user_error("{}: missing object 'splits'", where);
  for (auto& [name, sj] : j.at("splits").items()) {
    std::string w = fmt::format("{}: splits.{}", where, name);
    if (!sj.is_object()) user_error("{}: expected an object", w);
    SplitInfo s;
    s.samples = get_int(sj, "samples", w, 0);
    s.num_classes = get_int(sj, "num_classes", w, 1);
    s.channels = get_int(sj, "channels", w, 1);
    if (s.channels > 4) user_error("{}: 'channels' must be 1..4, got {}", w, s.channels);
    s.height = get_int(sj, "height", w, 0);  // 0 x 0: images of mixed sizes (loaders need data.image_size)
    s.width = get_int(sj, "width", w, 0);
    if ((s.height == 0) != (s.width == 0))
      user_error("{}: 'height' and 'width' are {} and {}: both > 0, or both 0 for mixed sizes", w, s.height, s.width);
    if (!sj.contains("shards") || !sj.at("shards").is_array()) user_error("{}: missing array 'shards'", w);
    int64_t total = 0;
    for (size_t i = 0; i < sj.at("shards").size(); ++i) {
      const json& shj = sj.at("shards")[i];
      std::string ws = fmt::format("{}.shards[{}]", w, i);
      if (!shj.is_object()) user_error("{}: expected an object", ws);
      ShardInfo sh;
      sh.file = get_str(shj, "file", ws);
      if (sh.file.empty() || fs::path(sh.file).is_absolute() || sh.file.find("..") != std::string::npos)
        user_error("{}: 'file' must be a relative path inside the dataset, got '{}'", ws, sh.file);
      sh.samples = get_int(shj, "samples", ws, 0);
      sh.sha256 = get_str(shj, "sha256", ws);
      if (!is_sha256_hex(sh.sha256)) user_error("{}: 'sha256' must be 64 lowercase hex digits", ws);
      total += sh.samples;
      s.shards.push_back(sh);
    }
    if (total != s.samples)
      user_error("{}: 'samples' is {} but its shards hold {} samples", w, s.samples, total);
    m.splits[name] = s;
  }
  return m;
}

std::string manifest_to_json(const Manifest& m) {
  using ojson = nlohmann::ordered_json;  // keys in the documented order
  ojson j = ojson::object();
  j["format"] = kManifestFormat;
  j["version"] = kManifestVersion;
  ojson splits = ojson::object();
  for (const auto& [name, s] : m.splits) {
    ojson shards = ojson::array();
    for (const auto& sh : s.shards) shards.push_back({{"file", sh.file}, {"samples", sh.samples}, {"sha256", sh.sha256}});
    splits[name] = {{"samples", s.samples}, {"num_classes", s.num_classes}, {"channels", s.channels},
                    {"height", s.height},   {"width", s.width},             {"shards", shards}};
  }
  j["splits"] = splits;
  j["classes"] = m.classes;
  return j.dump(2) + "\n";
}

void write_manifest(const std::string& path, const Manifest& m) {
  std::string text = manifest_to_json(m);
  std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fault("cannot create {}: {}", tmp, strerror(errno));
  size_t off = 0;
  while (off < text.size()) {
    ssize_t w = ::write(fd, text.data() + off, text.size() - off);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      ::close(fd);
      fault("write to {} failed: {}", tmp, strerror(errno));
    }
    off += size_t(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) fault("fsync/close {} failed: {}", tmp, strerror(errno));
  if (::rename(tmp.c_str(), path.c_str()) != 0) fault("rename {} -> {} failed: {}", tmp, path, strerror(errno));
}

void SplitSize::add(int width, int height, const std::string& where) {
  if (first_.empty()) {
    w_ = width, h_ = height, first_ = where;
  } else if (!mixed_ && (width != w_ || height != h_)) {
    mixed_ = true;
    other_ = fmt::format("{} is {}x{}", where, width, height);
  }
}

void SplitSize::apply(SplitInfo& s, const std::string& split) const {
  s.width = mixed_ ? 0 : w_;
  s.height = mixed_ ? 0 : h_;
  if (mixed_)
    log::warn("split '{}' has images of mixed sizes ({} is {}x{}, {}): recorded as 0x0; recipes on it need data.image_size",
              split, first_, w_, h_, other_);
}

std::string verify_split(const std::string& root, const std::string& split_name, const SplitInfo& s) {
  for (const auto& sh : s.shards) {
    fs::path p = fs::path(root) / sh.file;
    std::error_code ec;
    if (!fs::is_regular_file(p, ec)) return fmt::format("{}: shard of split '{}' is missing", p.string(), split_name);
    std::string got = sha256_file(p.string());
    if (got != sh.sha256)
      return fmt::format("{}: sha256 {} does not match the manifest ({}); the shard is corrupt or was modified",
                         p.string(), got, sh.sha256);
  }
  return "";
}

}  // namespace dtrain::data
