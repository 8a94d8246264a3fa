// ZeRO-3 mixed precision on the wire (parallel.zero = 3, FSDP's MixedPrecision(param_dtype,
// reduce_dtype)), end to end through the real binary and the launcher on CPU with Gloo: a tiny
// GPT on 2 ranks against ONE process with grad_accum 2 (the same micro-batches), 20 steps.
//
//  * precision bf16, reduce_dtype f32: each rank casts its f32 shard to bf16 before the
//    all-gather, which is the bf16 a cast of the gathered f32 gives (per element), and the norm
//    parameters (read in f32) are gathered in f32 besides: the computation is the single
//    process's up to the order of the f32 gradient sums, so the losses stay within the
//    existing 1e-5 relative (tests/train/test_mixed_precision_dist.cpp).
//  * reduce_dtype bf16: every gradient element is rounded to bf16 three times (the cast of
//    each rank's window, the pairwise sum; the halving is exact on 2 ranks), a relative error
//    of at most 3 * 2^-9 = 0.6% per element. AdamW's normalised update (about lr per element
//    and step) then moves each weight by at most 0.6% of its own movement differently; the
//    loss falls about 15% over the 20 steps, so the losses differ by at most ~0.6% * 15% =
//    9e-4 relative; asserted: 1e-3 relative on every step (measured: 6.4e-5 in bf16, 5.9e-6
//    in fp32, where the f32 run's 1e-5 would fail for bf16).
//  * bytes (Zero3::traffic, the run_end event's zero3_bytes): the bf16 windows' all-gather is
//    exactly half the f32 master gather of a precision fp32 run, and the bf16 reduce-scatter
//    half the f32 one; the norm parameters' f32 pack comes on top.
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>

#include "train_fixtures.h"

namespace {

std::string z3_recipe(const std::string& name, const std::string& dtype, const std::string& reduce) {
  stdfs::create_directories(kWork);
  clean(name);
  const std::string path = kWork + "/" + name + ".toml";
  std::ofstream f(path);
  f << "[run]\nname = \"" << name << "\"\nout_dir = \"" << kWork << "/runs\"\nseed = 5\ndevice = \"cpu\"\nthreads = 1\n"
    << "[model]\nkind = \"gpt\"\nn_layer = 2\nn_head = 2\nn_embd = 32\nblock_size = 16\nvocab_size = 96\n"
    << "[data]\nkind = \"synthetic\"\n[train]\nbatch_size = 4\nmax_steps = 20\n[optim]\nname = \"adamw\"\nlr = 1e-3\n"
    << "[log]\nevery_steps = 1\n[parallel]\ntimeout_s = 20\nreduce_dtype = \"" << reduce << "\"\n"
    << "[precision]\ndtype = \"" << dtype << "\"\n";
  return path;
}

nlohmann::json zero3_bytes(const std::string& name) {
  for (const auto& e : jsonl(run_dir(name) + "/events.jsonl"))
    if (e.value("event", "") == "run_end") return e.value("zero3_bytes", nlohmann::json());
  return nlohmann::json();
}

// The largest relative loss difference over the 20 steps; CHECKs each against `tol`.
double compare(const std::string& run, const std::string& ref, double tol) {
  const auto a = losses(run), b = losses(ref);
  REQUIRE(a.size() == 20);
  REQUIRE(b.size() == 20);
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    INFO(run << " step " << i + 1 << ": " << a[i] << " vs " << b[i]);
    CHECK(std::abs(a[i] - b[i]) <= tol * std::abs(b[i]));
    worst = std::max(worst, std::abs(a[i] - b[i]) / std::abs(b[i]));
  }
  return worst;
}

CmdResult train2(const std::string& recipe, int port) {
  return run_cmd(kBin + " train " + recipe + " --set parallel.zero=3 --nproc-per-node 2 --master-port " +
                 std::to_string(port));
}

}  // namespace

TEST_SUITE("integration") {

TEST_CASE("zero3 dtype: a bf16 all-gather and a bf16 reduce-scatter on 2 ranks track 1 process with grad_accum 2") {
  auto ref = run_cmd(kBin + " train " + z3_recipe("zd_ref", "bf16", "f32") + " --set train.grad_accum=2");
  REQUIRE_MESSAGE(ref.code == 0, ref.all());
  auto g16 = train2(z3_recipe("zd_g16", "bf16", "f32"), 29911);
  REQUIRE_MESSAGE(g16.code == 0, g16.all());
  auto r16 = train2(z3_recipe("zd_r16", "bf16", "bf16"), 29913);
  REQUIRE_MESSAGE(r16.code == 0, r16.all());
  auto f32 = train2(z3_recipe("zd_f32", "fp32", "f32"), 29915);
  REQUIRE_MESSAGE(f32.code == 0, f32.all());

  const double d_g16 = compare("zd_g16", "zd_ref", 1e-5);
  const double d_r16 = compare("zd_r16", "zd_ref", 1e-3);
  MESSAGE("bf16 vs 1 process: reduce f32 largest relative loss difference " << d_g16 << ", reduce bf16 " << d_r16);
  CHECK(losses("zd_r16") != losses("zd_g16"));  // the bf16 reduction is really another computation

  const auto b16 = zero3_bytes("zd_g16"), r = zero3_bytes("zd_r16"), b32 = zero3_bytes("zd_f32");
  INFO("bf16: " << b16.dump() << " bf16 reduce: " << r.dump() << " fp32: " << b32.dump());
  REQUIRE(b16.is_object());
  REQUIRE(r.is_object());
  REQUIRE(b32.is_object());
  const int64_t w16 = b16["allgather"].get<int64_t>() - b16["allgather_f32"].get<int64_t>();
  CHECK(b32["allgather_f32"] == 0);
  CHECK(b16["allgather_f32"].get<int64_t>() > 0);  // the LayerNorms' f32 pack
  CHECK(2 * w16 == b32["allgather"].get<int64_t>());
  CHECK(r["allgather"] == b16["allgather"]);
  CHECK(2 * r["reduce_scatter"].get<int64_t>() == b16["reduce_scatter"].get<int64_t>());
  CHECK(b16["reduce_scatter"] == b32["reduce_scatter"]);
  CHECK(r["reduce_dtype"] == "bf16");
  CHECK(b16["reduce_dtype"] == "f32");
  MESSAGE("all-gather bytes bf16/fp32: windows " << double(w16) / b32["allgather"].get<double>() << ", with the f32 pack "
                                                << b16["allgather"].get<double>() / b32["allgather"].get<double>()
                                                << "; reduce-scatter bytes bf16/f32 "
                                                << r["reduce_scatter"].get<double>() / b16["reduce_scatter"].get<double>());
}

TEST_CASE("zero3 dtype: precision fp32 with reduce_dtype bf16 reduces the f32 gradients in bf16") {
  auto ref = run_cmd(kBin + " train " + z3_recipe("zd_ref32", "fp32", "f32") + " --set train.grad_accum=2");
  REQUIRE_MESSAGE(ref.code == 0, ref.all());
  auto r16 = train2(z3_recipe("zd_f32_r16", "fp32", "bf16"), 29917);
  REQUIRE_MESSAGE(r16.code == 0, r16.all());
  const double d = compare("zd_f32_r16", "zd_ref32", 1e-3);  // the same bound as above: 3 roundings per element
  MESSAGE("fp32 with a bf16 reduce-scatter vs 1 process: largest relative loss difference " << d);
  CHECK(d > 0);
  const auto b = zero3_bytes("zd_f32_r16");
  REQUIRE(b.is_object());
  CHECK(b["reduce_dtype"] == "bf16");
  CHECK(b["allgather_f32"] == 0);  // fp32: the f32 master is gathered, no pack
}

TEST_CASE("zero3 dtype: hybrid sharding on 4 ranks reduces in bf16 within and across the shard groups") {
  // Each element: the cast, the shard group's pairwise sum, the replicate group's pairwise sum
  // (both halvings exact): 3 bf16 roundings, as above, plus the replicate sum's: <= 4 * 2^-9 =
  // 0.8% per element, so ~0.8% * 15% = 1.2e-3 on the losses; asserted 1.5e-3.
  auto ref = run_cmd(kBin + " train " + z3_recipe("zd_hy_ref", "bf16", "f32") + " --set train.grad_accum=4");
  REQUIRE_MESSAGE(ref.code == 0, ref.all());
  auto hy = run_cmd(kBin + " train " + z3_recipe("zd_hy", "bf16", "bf16") +
                    " --set parallel.zero=3 --set parallel.shard_group_size=2 --nproc-per-node 4 --master-port 29921");
  REQUIRE_MESSAGE(hy.code == 0, hy.all());
  CHECK(hy.all().find("ZeRO-3 hybrid sharding: shard groups of 2 ranks, 2 replicas") != std::string::npos);
  const double d = compare("zd_hy", "zd_hy_ref", 1.5e-3);
  MESSAGE("hybrid 2x2, bf16 gather and reduce vs 1 process: largest relative loss difference " << d);
  const auto b = zero3_bytes("zd_hy");
  REQUIRE(b.is_object());
  CHECK(b["reduce_dtype"] == "bf16");
}

TEST_CASE("zero3 dtype: a bad parallel.reduce_dtype or bf16 without ZeRO-3 is a one-line user error") {
  auto bad = run_cmd(kBin + " train " + z3_recipe("zd_bad", "bf16", "f16"));
  INFO(bad.all());
  CHECK(bad.code == 2);
  CHECK(bad.err_lines() == 1);
  CHECK(bad.err.find("parallel.reduce_dtype") != std::string::npos);
  CHECK(!stdfs::exists(run_dir("zd_bad")));
  for (const char* zero : {"0", "2"}) {
    const std::string msg = std::string("parallel.reduce_dtype = \"bf16\" needs parallel.zero = 3, but parallel.zero is ") + zero;
    auto one = run_cmd(kBin + " train " + z3_recipe("zd_bad0", "bf16", "bf16") + " --set parallel.zero=" + zero);
    INFO(one.all());
    CHECK(one.code == 2);
    CHECK(one.err_lines() == 1);
    CHECK(one.err.find(msg) != std::string::npos);
    auto two = run_cmd(kBin + " train " + z3_recipe("zd_bad2", "bf16", "bf16") + " --set parallel.zero=" + zero +
                       " --nproc-per-node 2 --master-port 29919");
    INFO(two.all());
    CHECK(two.code == 2);
    CHECK(two.err_lines() == 1);
    CHECK(two.err.find(msg) != std::string::npos);
    CHECK(!stdfs::exists(run_dir("zd_bad2")));
  }
}

}  // TEST_SUITE integration
