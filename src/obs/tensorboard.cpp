#include "obs/tensorboard.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "core/error.h"
#include "core/fsutil.h"
#include "obs/crc32c.h"

namespace dtrain {

namespace {

// ---- minimal protobuf wire encoding ----
enum Wire : uint32_t { kVarint = 0, kFixed64 = 1, kLen = 2, kFixed32 = 5 };

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(char(uint8_t(v) | 0x80));
    v >>= 7;
  }
  out.push_back(char(uint8_t(v)));
}
void put_tag(std::string& out, uint32_t field, Wire w) { put_varint(out, (uint64_t(field) << 3) | w); }
void put_fixed(std::string& out, const void* p, size_t n) {  // little-endian host (x86-64, aarch64)
  out.append(static_cast<const char*>(p), n);
}
void put_double(std::string& out, uint32_t field, double v) {
  put_tag(out, field, kFixed64);
  put_fixed(out, &v, 8);
}
void put_float(std::string& out, uint32_t field, float v) {
  put_tag(out, field, kFixed32);
  put_fixed(out, &v, 4);
}
void put_bytes(std::string& out, uint32_t field, const std::string& s) {
  put_tag(out, field, kLen);
  put_varint(out, s.size());
  out += s;
}
void put_int64(std::string& out, uint32_t field, int64_t v) {
  put_tag(out, field, kVarint);
  put_varint(out, uint64_t(v));  // int64 negatives take 10 bytes (two's complement)
}

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

// Event field numbers (tensorflow/core/util/event.proto).
constexpr uint32_t kEventWallTime = 1, kEventStep = 2, kEventFileVersion = 3, kEventSummary = 5, kEventSessionLog = 7;
// SessionLog.status = 1 (enum SessionStatus: START = 1).
constexpr uint32_t kSessionLogStatus = 1, kSessionStart = 1;
// Summary.value = 1; Summary.Value.tag = 1, simple_value = 2, tensor = 8, metadata = 9.
constexpr uint32_t kSummaryValue = 1, kValueTag = 1, kValueSimple = 2, kValueTensor = 8, kValueMetadata = 9;
// SummaryMetadata.plugin_data = 1 {plugin_name = 1, content = 2}.
constexpr uint32_t kMetaPluginData = 1, kPluginName = 1, kPluginContent = 2;
// HParamsPluginData: version = 1, session_start_info = 3, session_end_info = 4.
// SessionStartInfo: hparams = 1 (map<string, google.protobuf.Value>: entry key = 1, value = 2),
// group_name = 4, start_time_secs = 5. SessionEndInfo: status = 1, end_time_secs = 2.
// google.protobuf.Value: number_value = 2, string_value = 3, bool_value = 4.
constexpr uint32_t kHpVersion = 1, kHpStart = 3, kHpEnd = 4, kStartHparams = 1, kStartGroup = 4,
                   kStartTime = 5, kEndStatus = 1, kEndTime = 2, kMapKey = 1, kMapValue = 2, kPbNumber = 2,
                   kPbString = 3, kPbBool = 4;

// An Event at `step` (none when negative) holding a Summary with the one encoded Summary.Value.
std::string summary_event(double wall_time, int64_t step, const std::string& value) {
  std::string summary;
  put_bytes(summary, kSummaryValue, value);
  std::string e;
  put_double(e, kEventWallTime, wall_time);
  if (step >= 0) put_int64(e, kEventStep, step);
  put_bytes(e, kEventSummary, summary);
  return e;
}

// An Event holding one Summary.Value with the hparams plugin's metadata and the null tensor
// (an empty DT_FLOAT tensor of shape [0], as TensorBoard's own hparams summaries carry). The
// plugin's content is an HParamsPluginData (version 0) holding `info` as its field `field`
// (session_start_info or session_end_info).
std::string hparams_event(double wall_time, const std::string& tag, uint32_t field, const std::string& info) {
  std::string plugin_content;
  put_int64(plugin_content, kHpVersion, 0);
  put_bytes(plugin_content, field, info);
  std::string plugin;
  put_bytes(plugin, kPluginName, "hparams");
  put_bytes(plugin, kPluginContent, plugin_content);
  std::string meta;
  put_bytes(meta, kMetaPluginData, plugin);
  std::string shape, dim, tensor;
  put_bytes(shape, 2, dim);  // TensorShapeProto.dim = 2 {size = 0}
  put_int64(tensor, 1, 1);   // TensorProto.dtype = DT_FLOAT
  put_bytes(tensor, 2, shape);
  std::string v;
  put_bytes(v, kValueTag, tag);
  put_bytes(v, kValueTensor, tensor);
  put_bytes(v, kValueMetadata, meta);
  return summary_event(wall_time, -1, v);
}

}  // namespace

std::string tb_encode_file_version_event(double wall_time) {
  std::string e;
  put_double(e, kEventWallTime, wall_time);
  put_bytes(e, kEventFileVersion, "brain.Event:2");
  return e;
}

std::string tb_encode_scalar_event(double wall_time, int64_t step, const std::string& tag, float value) {
  std::string v;
  put_bytes(v, kValueTag, tag);
  put_float(v, kValueSimple, value);
  return summary_event(wall_time, step, v);
}

std::string tb_encode_hparams_event(double wall_time, const HParams& hp, const std::string& group,
                                    double start_time_s) {
  std::string start;
  for (const auto& [name, value] : hp) {
    std::string pv;
    if (const double* d = std::get_if<double>(&value)) put_double(pv, kPbNumber, *d);
    else if (const std::string* str = std::get_if<std::string>(&value)) put_bytes(pv, kPbString, *str);
    else put_int64(pv, kPbBool, std::get<bool>(value) ? 1 : 0);
    std::string entry;
    put_bytes(entry, kMapKey, name);
    put_bytes(entry, kMapValue, pv);
    put_bytes(start, kStartHparams, entry);
  }
  put_bytes(start, kStartGroup, group);
  put_double(start, kStartTime, start_time_s);
  return hparams_event(wall_time, "_hparams_/session_start_info", kHpStart, start);
}

std::string tb_encode_session_end_event(double wall_time, bool success) {
  std::string end;
  put_int64(end, kEndStatus, success ? 1 : 2);  // STATUS_SUCCESS | STATUS_FAILURE
  put_double(end, kEndTime, wall_time);
  return hparams_event(wall_time, "_hparams_/session_end_info", kHpEnd, end);
}

std::string tb_encode_session_start_event(double wall_time, int64_t step) {
  std::string log;
  put_int64(log, kSessionLogStatus, kSessionStart);
  std::string e;
  put_double(e, kEventWallTime, wall_time);
  put_int64(e, kEventStep, step);
  put_bytes(e, kEventSessionLog, log);
  return e;
}

std::string tb_frame_record(const std::string& data) {
  std::string r;
  uint64_t len = data.size();
  uint8_t lenb[8];
  for (int i = 0; i < 8; ++i) lenb[i] = uint8_t(len >> (8 * i));
  uint32_t lcrc = crc32c_masked(crc32c(lenb, 8));
  uint32_t dcrc = crc32c_masked(crc32c(data.data(), data.size()));
  auto put32 = [&](uint32_t v) {
    for (int i = 0; i < 4; ++i) r.push_back(char(uint8_t(v >> (8 * i))));
  };
  r.append(reinterpret_cast<const char*>(lenb), 8);
  put32(lcrc);
  r += data;
  put32(dcrc);
  return r;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  fs::mkdirs(dir);
  char host[256] = {0};
  if (::gethostname(host, sizeof host - 1) != 0 || host[0] == 0) std::strcpy(host, "localhost");
  double t = now_seconds();
  char name[400];
  // The last field counts writers within this process, so two never share a file.
  static std::atomic<int> seq{0};
  std::snprintf(name, sizeof name, "events.out.tfevents.%010lld.%s.%d.%d", (long long)t, host, int(::getpid()),
                seq.fetch_add(1));
  path_ = dir + "/" + name;
  f_ = std::fopen(path_.c_str(), "ab");
  if (!f_) fault("cannot create TensorBoard event file {}: {}", path_, std::strerror(errno));
  write_record(tb_encode_file_version_event(t));
  flush();
}

TensorBoardWriter::~TensorBoardWriter() {
  if (f_) std::fclose(f_);
}

void TensorBoardWriter::write_record(const std::string& data) {
  std::string r = tb_frame_record(data);
  if (std::fwrite(r.data(), 1, r.size(), f_) != r.size())
    fault("cannot write TensorBoard event file {}: {}", path_, std::strerror(errno));
}

void TensorBoardWriter::scalar(const std::string& tag, float value, int64_t step) {
  write_record(tb_encode_scalar_event(now_seconds(), step, tag, value));
}

void TensorBoardWriter::hparams(const HParams& hp, const std::string& group, double start_time_s) {
  write_record(tb_encode_hparams_event(now_seconds(), hp, group, start_time_s));
}

void TensorBoardWriter::session_end(bool success) { write_record(tb_encode_session_end_event(now_seconds(), success)); }

void TensorBoardWriter::restart_at(int64_t step) { write_record(tb_encode_session_start_event(now_seconds(), step)); }

void TensorBoardWriter::flush() {
  if (std::fflush(f_) != 0) fault("cannot flush TensorBoard event file {}: {}", path_, std::strerror(errno));
}

}  // namespace dtrain
