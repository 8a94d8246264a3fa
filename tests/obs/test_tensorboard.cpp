// crc32c, TensorBoard event files (read back by the real tensorboard package), JSONL sinks.
#include <doctest/doctest.h>
#include "test_util.h"
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/fsutil.h"
#include "obs/crc32c.h"
#include "obs/jsonl.h"
#include "obs/tensorboard.h"

using namespace dtrain;
using test_util::TmpDir;
using test_util::run_python;

namespace {

}  // namespace

TEST_SUITE("unit") {
TEST_CASE("crc32c known answers") {
  CHECK(crc32c("123456789", 9) == 0xE3069283u);
  CHECK(crc32c("", 0) == 0u);
  std::string zeros(32, '\0'), ones(32, '\xff');
  CHECK(crc32c(zeros.data(), 32) == 0x8A9136AAu);  // RFC 3720 B.4
  CHECK(crc32c(ones.data(), 32) == 0x62A8AB43u);
  CHECK(crc32c(crc32c("1234", 4), "56789", 5) == 0xE3069283u);  // continuation
  uint32_t c = 0x12345678u;
  CHECK(crc32c_masked(c) == uint32_t(((c >> 15) | (c << 17)) + 0xa282ead8u));
}

TEST_CASE("tensorboard: protobuf encoding of a scalar event") {
  std::string e = tb_encode_scalar_event(1.0, 300, "a", 2.0f);
  // Event: 09 <double 1.0> 10 <varint 300 = ac 02> 2a <len> Summary{0a <len> Value{0a 01 'a' 15 <float 2.0>}}
  std::string expect = std::string("\x09\x00\x00\x00\x00\x00\x00\xf0\x3f", 9) + "\x10\xac\x02" + "\x2a\x0a" +
                       "\x0a\x08" + "\x0a\x01" + "a" + std::string("\x15\x00\x00\x00\x40", 5);
  CHECK(e == expect);
  std::string r = tb_frame_record("abc");
  REQUIRE(r.size() == 8 + 4 + 3 + 4);
  CHECK(r.substr(0, 8) == std::string("\x03\0\0\0\0\0\0\0", 8));
  CHECK(r.substr(12, 3) == "abc");
  uint32_t dcrc;
  std::memcpy(&dcrc, r.data() + 15, 4);
  CHECK(dcrc == crc32c_masked(crc32c("abc", 3)));
}

TEST_CASE("jsonl: one object per line in append mode written at once and iso8601 timestamps") {
  TmpDir t;
  std::string p = t.path + "/metrics.jsonl";
  {
    JsonlWriter w(p);
    w.write({{"step", 1}, {"loss", 2.5}});
    // flushed: visible before the writer closes
    CHECK(fs::read_file(p) == "{\"loss\":2.5,\"step\":1}\n");
    w.write({{"event", "checkpoint"}, {"path", "a\nb"}});
  }
  {
    JsonlWriter w(p);  // appends
    w.write({{"step", 2}});
  }
  std::istringstream in(fs::read_file(p));
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    CHECK(nlohmann::json::accept(line));
    ++n;
  }
  CHECK(n == 3);
  std::string ts = iso8601_now();
  INFO(ts);
  REQUIRE(ts.size() == 24);
  CHECK(ts[4] == '-');
  CHECK(ts[10] == 'T');
  CHECK(ts[19] == '.');
  CHECK(ts.back() == 'Z');
  CHECK(ts.substr(0, 2) == "20");
  CHECK_THROWS_AS(JsonlWriter(t.path + "/no/such/dir/x.jsonl"), RuntimeFault);
}

TEST_CASE("jsonl: a last line cut short by a killed writer is dropped on open and appends stay valid") {
  TmpDir t;
  const std::string p = t.path + "/events.jsonl";
  const std::string done = "{\"event\":\"checkpoint\",\"step\":4}\n";
  for (const std::string& partial : {std::string("{\"event\":\"check"), std::string(9000, 'x')}) {
    fs::write_file(p, done + done + partial);  // a long partial line spans several read chunks
    {
      JsonlWriter w(p);
      w.write({{"event", "resumed"}});
    }
    CHECK(fs::read_file(p) == done + done + "{\"event\":\"resumed\"}\n");
  }
  fs::write_file(p, "no newline at all");
  { JsonlWriter w(p); }
  CHECK(fs::read_file(p).empty());
  fs::write_file(p, done);  // complete files are never touched
  { JsonlWriter w(p); }
  CHECK(fs::read_file(p) == done);
}
}

TEST_SUITE("integration") {
TEST_CASE("tensorboard: the tensorboard package reads dtrain's event file") {
  TmpDir t;
  std::string logdir = t.path + "/run";
  std::string path;
  {
    TensorBoardWriter w(logdir);
    path = w.path();
    for (int64_t s = 0; s < 10; ++s) {
      w.scalar("train/loss", 5.0f - 0.25f * float(s), s * 10);
      if (s % 3 == 0) w.scalar("train/lr", 1e-3f * float(s + 1), s * 10);
      w.flush();
    }
    w.scalar("eval/acc", 0.875f, 1LL << 33);  // a step beyond 32 bits
  }
  CHECK(fs::base_name(path).rfind("events.out.tfevents.", 0) == 0);
  std::string out = run_python(t.path, R"(
import json, glob, struct
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
from tensorboard.compat.proto import event_pb2
files = glob.glob(")" + logdir + R"(/events.out.tfevents.*")
assert len(files) == 1, files
# Frame-level check with the reference crc code, and protobuf parse of every record.
data = open(files[0], "rb").read()
pos, events = 0, []
while pos < len(data):
    (n,) = struct.unpack("<Q", data[pos:pos + 8])
    assert struct.unpack("<I", data[pos + 8:pos + 12])[0] == masked_crc32c(data[pos:pos + 8])
    body = data[pos + 12:pos + 12 + n]
    assert struct.unpack("<I", data[pos + 12 + n:pos + 16 + n])[0] == masked_crc32c(body)
    ev = event_pb2.Event()
    ev.ParseFromString(body)
    events.append(ev)
    pos += 16 + n
assert events[0].file_version == "brain.Event:2", events[0]
assert events[0].wall_time > 1.6e9
ea = EventAccumulator(")" + logdir + R"(")
ea.Reload()
res = {"tags": sorted(ea.Tags()["scalars"]), "nrecords": len(events)}
for tag in res["tags"]:
    res[tag] = [[s.step, s.value, s.wall_time] for s in ea.Scalars(tag)]
print(json.dumps(res))
)");
  auto j = nlohmann::json::parse(out.substr(out.find('{')));
  CHECK(j["tags"] == nlohmann::json({"eval/acc", "train/loss", "train/lr"}));
  CHECK(j["nrecords"] == 1 + 10 + 4 + 1);
  const auto& loss = j["train/loss"];
  REQUIRE(loss.size() == 10);
  for (int s = 0; s < 10; ++s) {
    CHECK(loss[s][0] == s * 10);
    CHECK(loss[s][1].get<double>() == double(5.0f - 0.25f * float(s)));
    CHECK(loss[s][2].get<double>() > 1.6e9);
  }
  const auto& lr = j["train/lr"];
  REQUIRE(lr.size() == 4);
  CHECK(lr[3][0] == 90);
  CHECK(lr[3][1].get<double>() == double(1e-3f * 10.0f));
  CHECK(j["eval/acc"][0][0].get<int64_t>() == (1LL << 33));
  CHECK(j["eval/acc"][0][1].get<double>() == 0.875);
}
}
