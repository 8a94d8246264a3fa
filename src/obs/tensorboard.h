#pragma once
// TensorBoard event-file writer (no TensorFlow/protobuf dependency).
// File: <dir>/events.out.tfevents.<unix time, 10 digits>.<hostname>.<pid>.<n-th writer of the process>
// TFRecord framing per record: u64 LE length, u32 masked crc32c(length bytes), data,
// u32 masked crc32c(data). Data: a hand-encoded tensorflow.Event protobuf. The first
// record carries file_version "brain.Event:2"; each scalar is one Event with a
// Summary holding one Value{tag, simple_value}. Not thread-safe: one writer per thread.
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace dtrain {

// One hyperparameter of TensorBoard's HParams dashboard: a number, a string or a bool.
using HParamValue = std::variant<double, std::string, bool>;
using HParams = std::vector<std::pair<std::string, HParamValue>>;

class TensorBoardWriter {
 public:
  explicit TensorBoardWriter(const std::string& dir);  // creates dir if needed; RuntimeFault on I/O error
  ~TensorBoardWriter();                                 // flushes and closes
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  void scalar(const std::string& tag, float value, int64_t step);
  // The run's hyperparameters (HParams plugin, session_start_info: TensorBoard infers the
  // experiment's columns from them and the metrics from the scalar tags), and its end
  // (session_end_info with status success or failure).
  void hparams(const HParams& hp, const std::string& group, double start_time_s);
  void session_end(bool success);
  // A resumed run (another process appending to the run directory) starts its steps again at
  // `step`: an Event{step, session_log START}, on which TensorBoard drops what the earlier
  // files hold at steps >= step (the steps the resumed run writes again), as PyTorch's
  // SummaryWriter(purge_step=step) does.
  void restart_at(int64_t step);
  void flush();  // fflush: call once per logged step
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& data);
  std::string path_;
  FILE* f_ = nullptr;
};

// Protobuf encoding of one Event (exposed for tests).
std::string tb_encode_file_version_event(double wall_time);
std::string tb_encode_scalar_event(double wall_time, int64_t step, const std::string& tag, float value);
// HParams plugin events (tensorboard/plugins/hparams/plugin_data.proto, plugin data version 0).
std::string tb_encode_hparams_event(double wall_time, const HParams& hp, const std::string& group,
                                    double start_time_s);
std::string tb_encode_session_end_event(double wall_time, bool success);
// Event{wall_time, step, session_log{status START}}.
std::string tb_encode_session_start_event(double wall_time, int64_t step);
// One TFRecord frame around `data`.
std::string tb_frame_record(const std::string& data);

}  // namespace dtrain
