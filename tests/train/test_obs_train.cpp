// Observability in training: model FLOPs for MFU, straggler detection, and the per-rank
// fields of metrics.jsonl (a 2-rank CPU run with a deliberately slowed rank).
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <map>

#include <nlohmann/json.hpp>

#include "free_port.h"
#include "models/resnet.h"
#include "models/unet.h"
#include "nn/params.h"
#include "obs/stragglers.h"
#include "run_cmd.h"
#include "test_util.h"
#include "config/config.h"
#include "session/flops.h"

namespace stdfs = std::filesystem;

namespace {

const std::string kBin = dtrain_bin();
const std::string kWork = std::string(DTRAIN_BUILD_DIR) + "/test_obs_train";

std::string recipe(const std::string& name, const std::string& extra = "") {
  stdfs::create_directories(kWork);
  stdfs::remove_all(kWork + "/runs/" + name);
  std::string path = kWork + "/" + name + ".toml";
  std::ofstream f(path);
  f << "[run]\nname = \"" << name << "\"\nout_dir = \"" << kWork << "/runs\"\nseed = 7\ndevice = \"cpu\"\nthreads = 1\n"
    << "[model]\nkind = \"resnet\"\ndepth = 8\nwidth = 4\nstem = \"cifar\"\nin_channels = 1\nnum_classes = 10\n"
    << "[data]\nkind = \"synthetic\"\nsynthetic_height = 12\nsynthetic_width = 12\n"
    << "[train]\nbatch_size = 8\nmax_steps = 6\n"
    << "[optim]\nname = \"sgd\"\nlr = 0.05\nmomentum = 0.9\n"
    << "[checkpoint]\nevery_steps = 0\nkeep_last = 1\n"
    << "[eval]\nevery_steps = 0\n"
    << "[log]\nevery_steps = 3\n"
    << "[parallel]\ntimeout_s = 20\n"
    << extra;
  return path;
}

std::vector<nlohmann::json> train_rows(const std::string& name) {
  std::vector<nlohmann::json> rows;
  std::ifstream f(kWork + "/runs/" + name + "/metrics.jsonl");
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) {
      auto j = nlohmann::json::parse(line);
      if (j["kind"] == "train") rows.push_back(j);
    }
  return rows;
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("find_stragglers flags ranks more than 20% above the median rank") {
    CHECK(dtrain::find_stragglers({0.1}).empty());
    CHECK(dtrain::find_stragglers({0.1, 0.11, 0.1, 0.105}).empty());
    auto s = dtrain::find_stragglers({0.1, 0.1, 0.2, 0.1});
    REQUIRE(s.size() == 1);
    CHECK(s[0].rank == 2);
    CHECK(s[0].median_s == doctest::Approx(0.1));
    CHECK(s[0].excess == doctest::Approx(1.0));
    // two ranks: the median is their mean; 2x slower is 33% above it
    auto two = dtrain::find_stragglers({0.01, 0.02});
    REQUIRE(two.size() == 1);
    CHECK(two[0].rank == 1);
    // exactly at the threshold is not a straggler; unknown p50s are ignored
    CHECK(dtrain::find_stragglers({1.0, 1.0, 1.2}).empty());
    CHECK(dtrain::find_stragglers({NAN, 0.1, 0.1}).empty());
  }

  TEST_CASE("forward FLOPs of CIFAR ResNet-20 at 32x32 match the per-layer count") {
    dtrain::ParamStore ps;
    dtrain::ResNetSpec spec;
    spec.depth = 20;
    spec.stem = "cifar";
    spec.num_classes = 10;
    spec.in_channels = 3;
    auto model = dtrain::build_resnet(spec, ps);
    // multiply-accumulates, layer by layer (3x3 convs, 1x1 projection shortcuts)
    const double stem = 3.0 * 16 * 9 * 32 * 32;
    const double stage1 = 6 * (16.0 * 16 * 9 * 32 * 32);
    const double stage2 = 16.0 * 32 * 9 * 16 * 16 + 5 * (32.0 * 32 * 9 * 16 * 16) + 16.0 * 32 * 16 * 16;
    const double stage3 = 32.0 * 64 * 9 * 8 * 8 + 5 * (64.0 * 64 * 9 * 8 * 8) + 32.0 * 64 * 8 * 8;
    const double fc = 64.0 * 10;
    const double macs = stem + stage1 + stage2 + stage3 + fc;
    CHECK(macs == doctest::Approx(40.8e6).epsilon(0.01));  // the usual "41 M MACs" of ResNet-20
    CHECK(model->forward_flops(32, 32) == doctest::Approx(2 * macs));
  }

  TEST_CASE("forward FLOPs of a one-level U-Net count the transposed conv over its input") {
    dtrain::ParamStore ps;
    dtrain::UNetSpec spec;
    spec.depth = 1;
    spec.base_channels = 4;
    spec.in_channels = 1;
    spec.num_classes = 2;
    auto model = dtrain::build_unet(spec, ps);
    const double macs = 1.0 * 4 * 9 * 64 + 4.0 * 4 * 9 * 64      // down.0 at 8x8
                        + 4.0 * 8 * 9 * 16 + 8.0 * 8 * 9 * 16    // bottleneck at 4x4
                        + 8.0 * 4 * 4 * 16                       // up.0.up: 2x2 transposed, 4x4 inputs
                        + 8.0 * 4 * 9 * 64 + 4.0 * 4 * 9 * 64    // up.0.conv at 8x8
                        + 4.0 * 2 * 64;                          // head 1x1
    CHECK(model->forward_flops(8, 8) == doctest::Approx(2 * macs));
  }

  TEST_CASE("peak precision follows precision.dtype and precision.tf32") {
    CHECK(dtrain::peak_precision("fp32", true) == "tf32");
    CHECK(dtrain::peak_precision("fp32", false) == "fp32");
    CHECK(dtrain::peak_precision("bf16", true) == "bf16");
  }
}

TEST_SUITE("integration") {
  TEST_CASE("MFU on CPU only with observability.peak_tflops in the console and metrics.jsonl") {
    auto without = run_cmd(kBin + " train " + shell_quote(recipe("mfu_off")) + " --set train.max_steps=3");
    REQUIRE_MESSAGE(without.code == 0, without.all());
    CHECK(without.all().find("| mfu ") == std::string::npos);
    for (auto& r : train_rows("mfu_off")) CHECK_FALSE(r.contains("mfu"));

    auto with = run_cmd(kBin + " train " + shell_quote(recipe("mfu_on", "[observability]\npeak_tflops = 0.001\n")) +
                        " --set train.max_steps=3");
    REQUIRE_MESSAGE(with.code == 0, with.all());
    CHECK(with.all().find("| mfu ") != std::string::npos);
    auto rows = train_rows("mfu_on");
    REQUIRE(!rows.empty());
    REQUIRE(rows.back().contains("mfu"));
    const double mfu = rows.back()["mfu"].get<double>();
    CHECK(mfu > 0);
    CHECK(std::isfinite(mfu));
  }

  TEST_CASE("metrics.jsonl rows carry an ISO 8601 time and the window's step-time quantiles") {
    auto r = run_cmd(kBin + " train " + shell_quote(recipe("rows_time")));
    REQUIRE_MESSAGE(r.code == 0, r.all());
    auto rows = train_rows("rows_time");
    REQUIRE(rows.size() == 2);  // steps 3 and 6
    for (auto& row : rows) {
      const std::string t = row.value("time", "");
      INFO(row.dump());
      // 2026-11-25T08:12:09.757Z
      REQUIRE(t.size() == 24);
      CHECK(t[4] == '-');
      CHECK(t[10] == 'T');
      CHECK(t.back() == 'Z');
      const double p50 = row["step_p50_s"], p95 = row["step_p95_s"], p99 = row["step_p99_s"];
      CHECK(p50 > 0);
      CHECK(p50 <= p95);
      CHECK(p95 <= p99);
    }
    CHECK(rows[0]["time"].get<std::string>() <= rows[1]["time"].get<std::string>());
  }

  // /metrics of a GPT run: dtrain_samples_total counts sequences, dtrain_tokens_total tokens
  // (block_size per sequence); both the job's (2 ranks here, rank 0 serves), scraped live.
  TEST_CASE("prometheus: a 2-rank GPT run counts sequences as samples and tokens as tokens") {
    const int port = free_port();
    const std::string path = kWork + "/prom_gpt.toml";
    stdfs::remove_all(kWork + "/runs/prom_gpt");
    std::ofstream(path) << "[run]\nname = \"prom_gpt\"\nout_dir = \"" << kWork << "/runs\"\ndevice = \"cpu\"\nthreads = 1\n"
                        << "[model]\nkind = \"gpt\"\nn_layer = 1\nn_head = 2\nn_embd = 16\nblock_size = 8\nvocab_size = 64\n"
                        << "[data]\nkind = \"synthetic\"\n[train]\nbatch_size = 3\nmax_steps = 40\n"
                        << "[checkpoint]\nevery_steps = 0\n[eval]\nevery_steps = 0\n[log]\nevery_steps = 1\n"
                        << "[parallel]\ntimeout_s = 20\n";
    const std::string script = "import re, sys, time, urllib.request\n"
                               "for i in range(300):\n"
                               "    try:\n"
                               "        body = urllib.request.urlopen('http://127.0.0.1:" + std::to_string(port) + "/metrics', timeout=2).read().decode()\n"
                               "    except Exception:\n"
                               "        time.sleep(0.1); continue\n"
                               "    v = {m: float(x) for m, x in re.findall(r'^(dtrain_(?:step|samples_total|tokens_total))\\{[^}]*\\} (\\S+)$', body, re.M)}\n"
                               "    if v.get('dtrain_step', 0) >= 3:\n"
                               "        print(int(v['dtrain_step']), int(v['dtrain_samples_total']), int(v['dtrain_tokens_total'])); sys.exit(0)\n"
                               "    time.sleep(0.1)\n"
                               "sys.exit(1)\n";
    std::ofstream(kWork + "/prom_gpt.py") << script;
    auto r = run_cmd("DTRAIN_FAILPOINTS=train.slow_step=0:100 " + kBin + " train " + path +
                     " --nproc-per-node 2 --master-port " + std::to_string(free_port()) + " --metrics-port " +
                     std::to_string(port) + " > " + kWork + "/prom_gpt.log 2>&1 & L=$!; " +
                     std::string(DTRAIN_SOURCE_DIR) + "/.venv/bin/python " + kWork + "/prom_gpt.py; wait $L");
    INFO(r.all() << run_cmd("cat " + kWork + "/prom_gpt.log").out);
    REQUIRE(r.code == 0);
    std::istringstream in(r.out);
    int64_t step = 0, samples = 0, tokens = 0;
    in >> step >> samples >> tokens;
    CHECK(step >= 3);
    CHECK(samples == step * 3 * 2);      // batch 3 per rank, 2 ranks
    CHECK(tokens == step * 3 * 2 * 8);   // block_size 8
  }

  // A run that died after logging step 6 but before its step-6 checkpoint resumes from step 3
  // and logs steps 4-6 again: TensorBoard must show each step once, the resumed run's values
  // (the resumed process writes a SessionLog START at step 4, as SummaryWriter(purge_step=4)).
  TEST_CASE("tensorboard shows each step once after a resume that repeats steps") {
    auto r = run_cmd(kBin + " train " + shell_quote(recipe("tb_resume")) +
                     " --set log.tensorboard=true --set log.every_steps=1 --set checkpoint.every_steps=3 --set checkpoint.keep_last=5");
    REQUIRE_MESSAGE(r.code == 0, r.all());
    const std::string rd = kWork + "/runs/tb_resume";
    stdfs::remove_all(rd + "/checkpoints/step_00000006");
    std::ofstream(rd + "/checkpoints/latest") << "step_00000003\n";
    auto b = run_cmd(kBin + " train --resume " + rd + " --set optim.lr=0.01");  // other values from step 4 on
    REQUIRE_MESSAGE(b.code == 0, b.all());
    const std::string out = test_util::run_python(kWork, R"(
import json
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
ea = EventAccumulator(")" + rd + R"(")
ea.Reload()
print(json.dumps([[s.step, s.value] for s in ea.Scalars("train/loss")]))
)");
    INFO(out);
    const auto j = nlohmann::json::parse(out.substr(out.find('[')));
    std::map<int64_t, double> last;  // metrics.jsonl keeps both runs' rows: the later one of each step
    for (const auto& row : train_rows("tb_resume")) last[row["step"].get<int64_t>()] = row["loss"].get<double>();
    REQUIRE(j.size() == 6);
    REQUIRE(last.size() == 6);
    for (size_t i = 0; i < 6; ++i) {
      CHECK(j[i][0].get<int64_t>() == int64_t(i + 1));
      CHECK(j[i][1].get<double>() == doctest::Approx(last[int64_t(i + 1)]).epsilon(1e-6));
    }
    CHECK(j[5][1].get<double>() != doctest::Approx(train_rows("tb_resume")[5]["loss"].get<double>()).epsilon(1e-6));
  }

  TEST_CASE("tensorboard reads a training run's grad norm - step phases - memory and the recipe as hparams") {
    auto r = run_cmd(kBin + " train " + shell_quote(recipe("tb_scalars")) +
                     " --set train.clip_grad_norm=5.0 --set log.tensorboard=true --set optim.lr=0.0375");
    REQUIRE_MESSAGE(r.code == 0, r.all());
    const std::string out = test_util::run_python(kWork, R"(
import json
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
ea = EventAccumulator(")" + kWork + R"(/runs/tb_scalars")
ea.Reload()
print(json.dumps({t: [[s.step, s.value] for s in ea.Scalars(t)] for t in ea.Tags()["scalars"]}))
)");
    const auto j = nlohmann::json::parse(out.substr(out.find('{')));
    const auto rows = train_rows("tb_scalars");
    REQUIRE(rows.size() == 2);
    for (const char* tag : {"train/grad_norm", "time/step_s", "time/forward_s", "time/backward_s", "time/optimizer_s",
                            "time/data_s", "memory/peak_bytes", "memory/activation_bytes"}) {
      INFO(tag << ": " << out);
      REQUIRE(j.contains(tag));
      CHECK(j[tag].size() == 2);
      CHECK(j[tag][1][0] == 6);
    }
    CHECK(j["train/grad_norm"][1][1].get<double>() == doctest::Approx(rows[1]["grad_norm"].get<double>()).epsilon(1e-6));
    CHECK(j["memory/peak_bytes"][1][1].get<double>() == doctest::Approx(double(rows[1]["mem_peak_bytes"].get<int64_t>())).epsilon(1e-6));
    // HParams: the resolved recipe and the run's end, as TensorBoard's hparams plugin parses them
    const std::string hp_out = test_util::run_python(kWork, R"(
import json
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata, api_pb2
ea = EventAccumulator(")" + kWork + R"(/runs/tb_scalars")
ea.Reload()
content = ea.PluginTagToContent(metadata.PLUGIN_NAME)
start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
end = metadata.parse_session_end_info_plugin_data(content[metadata.SESSION_END_INFO_TAG])
hp = {k: v.WhichOneof("kind") + "=" + str(getattr(v, v.WhichOneof("kind"))) for k, v in start.hparams.items()}
print(json.dumps({"hp": hp, "group": start.group_name, "n": len(start.hparams),
                  "end": api_pb2.Status.Name(end.status), "start_time": start.start_time_secs}))
)");
    INFO(hp_out);
    const auto h = nlohmann::json::parse(hp_out.substr(hp_out.find('{')));
    CHECK(h["hp"]["optim.lr"] == "number_value=0.0375");
    CHECK(h["hp"]["train.clip_grad_norm"] == "number_value=5.0");
    CHECK(h["hp"]["model.kind"] == "string_value=resnet");
    CHECK(h["hp"]["train.batch_size"] == "number_value=8.0");
    CHECK(h["hp"]["log.tensorboard"] == "bool_value=True");
    CHECK(h["hp"]["data.mean"].get<std::string>().rfind("string_value=[", 0) == 0);
    CHECK(h["group"] == "tb_scalars");
    CHECK(h["n"].get<size_t>() == dtrain::config_schema().size());
    CHECK(h["end"] == "STATUS_SUCCESS");
    CHECK(h["start_time"].get<double>() > 1.7e9);
  }

  TEST_CASE("a slowed rank is reported as a straggler with its host and ranks go into metrics.jsonl") {
    auto r = run_cmd("DTRAIN_FAILPOINTS=train.slow_step=1:40 " + kBin + " train " +
                     shell_quote(recipe("straggle")) + " --nproc-per-node 2 --master-port 29671");
    REQUIRE_MESSAGE(r.code == 0, r.all());
    CHECK_MESSAGE(r.all().find("straggler: rank 1 on host ") != std::string::npos, r.all());
    CHECK(r.all().find("straggler: rank 0") == std::string::npos);
    auto rows = train_rows("straggle");
    REQUIRE(rows.size() == 2);  // steps 3 and 6
    for (auto& row : rows) {
      REQUIRE(row.contains("ranks"));
      REQUIRE(row["ranks"].size() == 2);
      CHECK(row["ranks"][1]["step_p50_s"].get<double>() > 0.04);
      CHECK(row["ranks"][1]["step_p50_s"].get<double>() > 1.2 * row["ranks"][0]["step_p50_s"].get<double>());
      CHECK(row["ranks"][0]["samples"].get<int64_t>() == 8 * row["step"].get<int64_t>());
      CHECK(!row["ranks"][1]["host"].get<std::string>().empty());
      REQUIRE(row.contains("stragglers"));
      CHECK(row["stragglers"] == nlohmann::json::array({1}));
    }
  }

  TEST_CASE("every log row of a 2-rank run carries both ranks") {
    auto r = run_cmd(kBin + " train " + shell_quote(recipe("even")) + " --nproc-per-node 2 --master-port 29672");
    REQUIRE_MESSAGE(r.code == 0, r.all());
    auto rows = train_rows("even");
    REQUIRE(rows.size() == 2);
    for (auto& row : rows) CHECK(row["ranks"].size() == 2);
  }
}
