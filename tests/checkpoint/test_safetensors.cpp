// safetensors writer/reader, checked against the reference Python implementation.
#include <doctest/doctest.h>
#include "test_util.h"
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "core/fsutil.h"
#include "checkpoint/safetensors.h"

using namespace dtrain;
using test_util::TmpDir;
using test_util::run_python;

namespace {

void write_bytes(const std::string& path, const std::string& bytes) { fs::write_file(path, bytes); }

// A hand-built safetensors file: header text as given (not padded), then data bytes.
std::string raw_file(const std::string& header, const std::string& data, uint64_t hlen_override = 0) {
  uint64_t n = hlen_override ? hlen_override : header.size();
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = char(uint8_t(n >> (8 * i)));
  return s + header + data;
}

void check_user_error(const std::string& path, const std::string& expect_substr) {
  try {
    SafetensorsReader r(path);
    FAIL("expected UserError for " << path << " (" << expect_substr << ")");
  } catch (const UserError& e) {
    std::string msg = e.what();
    INFO("message: " << msg);
    CHECK(msg.find(path) != std::string::npos);
    CHECK(msg.find(expect_substr) != std::string::npos);
    CHECK(msg.find('\n') == std::string::npos);
  }
}

}  // namespace

TEST_SUITE("unit") {
TEST_CASE("safetensors: own round trip of every dtype with empty and scalar tensors and metadata") {
  TmpDir t;
  std::vector<float> f32 = {1.5f, -2.25f, 3.0f, 1e-30f, 6.5e7f, -0.0f};
  std::vector<int64_t> i64 = {-1, 0, int64_t(1) << 40, 7};
  std::vector<uint8_t> u8 = {0, 1, 255};
  std::vector<uint16_t> bf = {f32_to_bf16(1.0f), f32_to_bf16(-3.5f)};
  std::vector<int32_t> scalar = {42};
  std::string path = t.path + "/a.safetensors";
  write_safetensors(path,
                    {{"w.f32", "F32", {2, 3}, f32.data(), f32.size() * 4},
                     {"i64", "I64", {4}, i64.data(), 32},
                     {"bytes", "U8", {3}, u8.data(), 3},
                     {"bf", "BF16", {1, 2}, bf.data(), 4},
                     {"empty", "F32", {0, 5}, nullptr, 0},
                     {"scalar", "I32", {}, scalar.data(), 4}},
                    {{"format", "pt"}, {"step", "100"}});
  // Data begins 8-byte aligned.
  std::string raw = fs::read_file(path);
  uint64_t hlen = 0;
  for (int i = 0; i < 8; ++i) hlen |= uint64_t(uint8_t(raw[i])) << (8 * i);
  CHECK((8 + hlen) % 8 == 0);

  SafetensorsReader r(path);
  CHECK(r.names() == std::vector<std::string>{"w.f32", "i64", "bytes", "bf", "empty", "scalar"});
  CHECK(r.has("i64"));
  CHECK_FALSE(r.has("nope"));
  CHECK(r.dtype("bf") == "BF16");
  CHECK(r.shape("w.f32") == std::vector<int64_t>{2, 3});
  CHECK(r.shape("scalar").empty());
  CHECK(r.nbytes("empty") == 0);
  CHECK(r.metadata().at("step") == "100");
  std::vector<float> f32b(6);
  r.read("w.f32", f32b.data(), 24);
  CHECK(std::memcmp(f32b.data(), f32.data(), 24) == 0);
  std::vector<int64_t> i64b(4);
  r.read("i64", i64b.data(), 32);
  CHECK(i64b == i64);
  std::vector<uint16_t> bfb(2);
  r.read("bf", bfb.data(), 4);
  CHECK(bf16_to_f32(bfb[1]) == -3.5f);
  int32_t s = 0;
  r.read("scalar", &s, 4);
  CHECK(s == 42);
  CHECK_THROWS_AS(r.read("w.f32", f32b.data(), 20), UserError);  // size mismatch
  CHECK_THROWS_AS(r.read("nope", f32b.data(), 4), UserError);
  CHECK_THROWS_AS(SafetensorsReader(t.path + "/missing.safetensors"), UserError);
}

TEST_CASE("safetensors: writer rejects inconsistent tensors") {
  TmpDir t;
  float x[4] = {};
  CHECK_THROWS_AS(write_safetensors(t.path + "/b.st", {{"x", "F32", {3}, x, 16}}, {}), RuntimeFault);
  CHECK_THROWS_AS(write_safetensors(t.path + "/b.st", {{"x", "F33", {4}, x, 16}}, {}), RuntimeFault);
  CHECK_THROWS_AS(write_safetensors(t.path + "/b.st", {{"x", "F32", {4}, x, 16}, {"x", "F32", {4}, x, 16}}, {}),
                  RuntimeFault);
}
}

TEST_SUITE("integration") {
TEST_CASE("safetensors: dtrain writes and the Python safetensors package reads") {
  TmpDir t;
  std::vector<float> f32(3 * 5);
  for (size_t i = 0; i < f32.size(); ++i) f32[i] = float(i) * 0.37f - 2.0f;
  std::vector<int64_t> i64 = {-5, 1LL << 50, 3};
  std::vector<int32_t> i32 = {7, -8};
  std::vector<uint16_t> u16 = {65535, 1, 2, 3};
  std::vector<uint16_t> f16 = {f32_to_f16(0.5f), f32_to_f16(-1024.0f)};
  std::vector<uint16_t> bf = {f32_to_bf16(2.0f), f32_to_bf16(-0.125f), f32_to_bf16(3.0f)};
  std::vector<uint8_t> u8 = {9, 200};
  std::string path = t.path + "/mine.safetensors";
  write_safetensors(path,
                    {{"layer1.0.conv1.weight", "F32", {3, 5}, f32.data(), f32.size() * 4},
                     {"i64", "I64", {3}, i64.data(), 24},
                     {"i32", "I32", {2}, i32.data(), 8},
                     {"u16", "U16", {2, 2}, u16.data(), 8},
                     {"f16", "F16", {2}, f16.data(), 4},
                     {"bf16", "BF16", {3}, bf.data(), 6},
                     {"u8", "U8", {2}, u8.data(), 2}},
                    {{"format", "pt"}, {"dtrain", "yes"}});
  std::string out = run_python(t.path, R"(
import json, sys
from safetensors import safe_open
p = ")" + path + R"("
res = {}
with safe_open(p, "np") as f:  # numpy has no bfloat16: that one goes through torch below
    for k in f.keys():
        if k != "bf16":
            v = f.get_tensor(k)
            res[k] = {"dtype": str(v.dtype), "shape": list(v.shape), "values": v.astype("float64").ravel().tolist()}
with safe_open(p, "pt") as f:  # torch 1.13 has no uint16, so only this tensor
    b = f.get_tensor("bf16")
res["bf16"] = {"dtype": str(b.dtype), "shape": list(b.shape), "values": b.float().tolist()}
with safe_open(p, "np") as f:
    res["__metadata__"] = f.metadata()
print(json.dumps(res))
)");
  auto j = nlohmann::json::parse(out.substr(out.find('{')));
  const auto& w = j["layer1.0.conv1.weight"];
  CHECK(w["dtype"] == "float32");
  CHECK(w["shape"] == nlohmann::json({3, 5}));
  for (size_t i = 0; i < f32.size(); ++i) CHECK(w["values"][i].get<double>() == double(f32[i]));
  CHECK(j["i64"]["dtype"] == "int64");
  CHECK(j["i64"]["values"][1].get<double>() == double(1LL << 50));
  CHECK(j["i32"]["values"] == nlohmann::json({7.0, -8.0}));
  CHECK(j["u16"]["dtype"] == "uint16");
  CHECK(j["u16"]["values"][0].get<double>() == 65535.0);
  CHECK(j["f16"]["values"] == nlohmann::json({0.5, -1024.0}));
  CHECK(j["bf16"]["dtype"] == "torch.bfloat16");
  CHECK(j["bf16"]["values"] == nlohmann::json({2.0, -0.125, 3.0}));
  CHECK(j["u8"]["values"] == nlohmann::json({9.0, 200.0}));
  CHECK(j["__metadata__"]["dtrain"] == "yes");
}

TEST_CASE("safetensors: the Python safetensors package writes and dtrain reads") {
  TmpDir t;
  std::string path = t.path + "/theirs.safetensors";
  run_python(t.path, R"(
import numpy as np
import torch, safetensors.torch
from safetensors.numpy import save_file
save_file({"a": (np.arange(12, dtype=np.float32) * 0.5 - 1).reshape(3, 4),
           "b": np.array([-3, 1 << 40], dtype=np.int64),
           "c": np.array([1, 2, 3], dtype=np.uint8),
           "h": np.array([1.5, -2.0], dtype=np.float16)},
          ")" + path + R"(", metadata={"format": "np", "k": "v"})
safetensors.torch.save_file({"bf": torch.tensor([1.0, -0.5], dtype=torch.bfloat16)}, ")" + t.path +
                                   R"(/bf.safetensors")
)");
  SafetensorsReader r(path);
  CHECK(r.names().size() == 4);
  CHECK(r.metadata().at("k") == "v");
  CHECK(r.dtype("a") == "F32");
  CHECK(r.shape("a") == std::vector<int64_t>{3, 4});
  std::vector<float> a(12);
  r.read("a", a.data(), 48);
  for (int i = 0; i < 12; ++i) CHECK(a[i] == float(i) * 0.5f - 1.0f);
  int64_t b[2];
  r.read("b", b, 16);
  CHECK(b[0] == -3);
  CHECK(b[1] == (int64_t(1) << 40));
  uint8_t c[3];
  r.read("c", c, 3);
  CHECK(c[2] == 3);
  uint16_t h[2];
  r.read("h", h, 4);
  CHECK(f16_to_f32(h[0]) == 1.5f);
  CHECK(f16_to_f32(h[1]) == -2.0f);
  SafetensorsReader rb(t.path + "/bf.safetensors");
  CHECK(rb.dtype("bf") == "BF16");
  uint16_t bf[2];
  rb.read("bf", bf, 4);
  CHECK(bf16_to_f32(bf[0]) == 1.0f);
  CHECK(bf16_to_f32(bf[1]) == -0.5f);
}
}

TEST_SUITE("unit") {
TEST_CASE("safetensors: malformed files are UserErrors naming the file and the problem") {
  TmpDir t;
  float x[4] = {1, 2, 3, 4};
  std::string good = t.path + "/good.safetensors";
  write_safetensors(good, {{"x", "F32", {4}, x, 16}, {"y", "F32", {2}, x, 8}}, {});
  std::string bytes = fs::read_file(good);
  auto p = [&](const char* n) { return t.path + "/" + n; };

  SUBCASE("too short for a length") {
    write_bytes(p("short"), "abc");
    check_user_error(p("short"), "shorter than the 8-byte header length");
  }
  SUBCASE("truncated data") {
    write_bytes(p("trunc"), bytes.substr(0, bytes.size() - 3));
    check_user_error(p("trunc"), "truncated");
  }
  SUBCASE("truncated header") {
    write_bytes(p("trunch"), bytes.substr(0, 20));
    check_user_error(p("trunch"), "truncated");
  }
  SUBCASE("absurd header length") {
    write_bytes(p("hlen"), raw_file("{}", "", uint64_t(1) << 40));
    check_user_error(p("hlen"), "header length");
  }
  SUBCASE("header length past the end") {
    write_bytes(p("hlen2"), raw_file("{}", "", 1000));
    check_user_error(p("hlen2"), "header length 1000");
  }
  SUBCASE("bad JSON") {
    write_bytes(p("json"), raw_file(R"({"x": {"dtype": "F32",)", std::string(16, '\0')));
    check_user_error(p("json"), "malformed safetensors header JSON");
  }
  SUBCASE("header not an object") {
    write_bytes(p("arr"), raw_file("[1, 2]", ""));
    check_user_error(p("arr"), "not a JSON object");
  }
  SUBCASE("offsets out of range") {
    write_bytes(p("oor"), raw_file(R"({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 32]}})",
                                   std::string(16, '\0')));
    check_user_error(p("oor"), "beyond the 16 data bytes");
  }
  SUBCASE("unknown dtype") {
    write_bytes(p("dt"), raw_file(R"({"x": {"dtype": "F31", "shape": [4], "data_offsets": [0, 16]}})",
                                  std::string(16, '\0')));
    check_user_error(p("dt"), "unknown dtype 'F31'");
  }
  SUBCASE("dtype/shape disagree with offsets") {
    write_bytes(p("sz"), raw_file(R"({"x": {"dtype": "F16", "shape": [4], "data_offsets": [0, 16]}})",
                                  std::string(16, '\0')));
    check_user_error(p("sz"), "needs 8 bytes but data_offsets span 16");
  }
  SUBCASE("negative dimension") {
    write_bytes(p("neg"), raw_file(R"({"x": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}})",
                                   std::string(16, '\0')));
    check_user_error(p("neg"), "non-negative");
  }
  SUBCASE("overlap") {
    write_bytes(p("ovl"), raw_file(R"({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},)"
                                   R"( "y": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
                                   std::string(16, '\0')));
    check_user_error(p("ovl"), "overlap");
  }
  SUBCASE("gap") {
    write_bytes(p("gap"), raw_file(R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
                                   std::string(16, '\0')));
    check_user_error(p("gap"), "gap in data");
  }
  SUBCASE("trailing bytes") {
    write_bytes(p("trail"), bytes + "xx");
    check_user_error(p("trail"), "trailing bytes");
  }
  SUBCASE("missing data_offsets") {
    write_bytes(p("nooff"), raw_file(R"({"x": {"dtype": "F32", "shape": [4]}})", std::string(16, '\0')));
    check_user_error(p("nooff"), "data_offsets");
  }
  SUBCASE("metadata not strings") {
    write_bytes(p("meta"), raw_file(R"({"__metadata__": {"a": 1}})", ""));
    check_user_error(p("meta"), "__metadata__ key 'a'");
  }
}
}
