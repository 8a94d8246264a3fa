// The layout planner's output (table, JSON) and its comparison with published training runs
// (plan/layout_planner.h; docs/scaling.md, "Layout planner").
#include <fmt/format.h>

#include <map>

#include "plan/layout_planner.h"

namespace dtrain::parallel {

namespace {

constexpr double kGiB = double(int64_t(1) << 30);

std::string layout_str(const Layout& l) {
  return fmt::format("dp {} tp {} pp {} v {} zero {} recompute {} mbs {}", l.dp, l.tp, l.pp, l.v, l.zero,
                     recompute_name(l.recompute), l.mbs);
}

nlohmann::json layout_json(const Evaluated& e) {
  const Layout& l = e.layout;
  nlohmann::json j = {{"dp", l.dp}, {"tp", l.tp}, {"pp", l.pp}, {"v", l.v}, {"zero", l.zero},
                      {"recompute", recompute_name(l.recompute)}, {"mbs", l.mbs}};
  if (!e.reason.empty()) {
    j["reason"] = e.reason;
    j["why"] = e.excluded;
  }
  if (e.reason.empty() || e.reason == "memory") {
    j["micro_batches"] = e.micro_batches;
    j["memory_bytes"] = {{"weights", e.mem.weights},       {"grads", e.mem.grads},
                         {"optimizer", e.mem.optimizer},   {"zero_buffers", e.mem.zero_buffers},
                         {"activations", e.mem.activations}, {"reserve", e.mem.reserve},
                         {"total", e.mem.total()}};
    j["time_s"] = {{"compute", e.time.compute}, {"tp_comm", e.time.tp_comm},     {"bubble", e.time.bubble},
                   {"p2p", e.time.p2p},         {"dp_comm", e.time.dp_comm},     {"dp_exposed", e.time.dp_exposed},
                   {"optimizer", e.time.optimizer}, {"step", e.time.total()}};
    j["tokens_per_s_per_gpu"] = e.tokens_per_s_per_gpu;
    j["mfu"] = e.mfu;
  }
  return j;
}

std::map<std::string, int> reason_counts(const Plan& p) {
  std::map<std::string, int> n;
  for (const Evaluated& e : p.excluded) ++n[e.reason];
  return n;
}

}  // namespace

std::string plan_table(const Plan& p, int top, bool show_excluded) {
  const ModelShape& m = p.model;
  const Cluster& c = p.cluster;
  std::string out = fmt::format(
      "{}: {:.3f}B parameters, {} layers, width {}, {} heads, sequence {}, {:.3g} training FLOPs per token\n"
      "{} x {} ({} per node; {:.0f} TFLOP/s bf16, {:.0f} GiB; intra-node {:.0f} GB/s, inter-node {:.0f} GB/s per GPU)\n"
      "global batch {} sequences ({} tokens) per step\n\n",
      m.name, double(m.params()) / 1e9, m.n_layer, m.n_embd, m.n_head, m.seq, model_flops_per_token(m), c.gpus,
      c.gpu.name, c.gpus_per_node, c.gpu.peak_flops / 1e12, c.gpu.hbm_bytes / kGiB, c.gpu.intra_bytes_per_s / 1e9,
      c.gpu.inter_bytes_per_s / 1e9, p.train.global_batch, p.train.global_batch * m.seq);
  const size_t total = p.feasible.size() + p.excluded.size();
  if (p.feasible.empty()) {
    out += fmt::format("no layout fits: all {} excluded\n", total);
  } else {
    out += fmt::format("{} of {} layouts fit; the fastest {}:\n\n", p.feasible.size(), total,
                       std::min<size_t>(p.feasible.size(), size_t(top)));
    out += fmt::format("{:>4} {:>4} {:>3} {:>3} {:>2} {:>4} {:>9} {:>4} {:>5} {:>8} {:>9} {:>7} {:>10} {:>6}\n", "rank",
                       "dp", "tp", "pp", "v", "zero", "recompute", "mbs", "M", "mem GiB", "step s", "bubble",
                       "tok/s/GPU", "MFU");
    for (size_t i = 0; i < p.feasible.size() && i < size_t(top); ++i) {
      const Evaluated& e = p.feasible[i];
      const Layout& l = e.layout;
      out += fmt::format("{:>4} {:>4} {:>3} {:>3} {:>2} {:>4} {:>9} {:>4} {:>5} {:>8.1f} {:>9.3f} {:>6.1f}% {:>10.0f} {:>5.1f}%\n",
                         i + 1, l.dp, l.tp, l.pp, l.v, l.zero, recompute_name(l.recompute), l.mbs, e.micro_batches,
                         e.mem.total() / kGiB, e.time.total(), 100 * e.time.bubble / e.time.total(),
                         e.tokens_per_s_per_gpu, 100 * e.mfu);
    }
  }
  out += fmt::format("\nexcluded: {} layouts, by the first constraint each fails:\n", p.excluded.size());
  for (const auto& [reason, n] : reason_counts(p)) out += fmt::format("  {:<20} {}\n", reason, n);
  if (show_excluded)
    for (const Evaluated& e : p.excluded)
      out += fmt::format("  {}: {}: {}\n", layout_str(e.layout), e.reason, e.excluded);
  else if (!p.excluded.empty())
    out += "(--show-excluded lists each)\n";
  out +=
      "\nmem: stage 0 or the last stage, whichever holds more, with the reserve; step: compute + tensor-parallel\n"
      "all-reduces + bubble + pipeline sends + exposed data-parallel communication + optimizer (docs/scaling.md).\n";
  return out;
}

nlohmann::json plan_json(const Plan& p, int top) {
  nlohmann::json j;
  const ModelShape& m = p.model;
  j["model"] = {{"name", m.name},   {"params", m.params()}, {"n_layer", m.n_layer}, {"n_embd", m.n_embd},
                {"n_head", m.n_head}, {"seq", m.seq},       {"vocab", m.vocab},
                {"flops_per_token", model_flops_per_token(m)}};
  j["cluster"] = {{"gpu", p.cluster.gpu.name},
                  {"gpus", p.cluster.gpus},
                  {"gpus_per_node", p.cluster.gpus_per_node},
                  {"intra_bytes_per_s", p.cluster.gpu.intra_bytes_per_s},
                  {"inter_bytes_per_s", p.cluster.gpu.inter_bytes_per_s},
                  {"hbm_bytes", p.cluster.gpu.hbm_bytes}};
  j["global_batch"] = p.train.global_batch;
  j["feasible"] = p.feasible.size();
  j["ranked"] = nlohmann::json::array();
  for (size_t i = 0; i < p.feasible.size() && i < size_t(top); ++i) j["ranked"].push_back(layout_json(p.feasible[i]));
  j["excluded_by_reason"] = reason_counts(p);
  j["excluded"] = nlohmann::json::array();
  for (const Evaluated& e : p.excluded) j["excluded"].push_back(layout_json(e));
  return j;
}

std::vector<PublishedCase> published_cases() {
  std::vector<PublishedCase> out;
  // One published run: the model, `gpus` of `gpu` (its HBM overridden where the run's GPUs differ
  // from the table's: hbm_gib > 0), the global batch, the layout it used and its seconds per step
  // (and its memory per GPU where published); the prediction at that layout beside it.
  auto add = [&](const std::string& name, const std::string& source, const ModelShape& model, const GpuSpec& gpu,
                 int gpus, int64_t global_batch, const Layout& layout, double step_s, double mem_gib = 0) {
    PublishedCase pc;
    pc.name = name;
    pc.source = source;
    pc.model = model;
    pc.cluster.gpu = gpu;
    pc.cluster.gpus = gpus;
    pc.train.global_batch = global_batch;
    pc.layout = layout;
    pc.published_step_s = step_s;
    pc.published_mem_gib = mem_gib;
    pc.predicted_step_s = layout_time(pc.model, pc.cluster, pc.train, pc.layout).total();
    const double flops = double(pc.train.global_batch) * pc.model.seq * model_flops_per_token(pc.model);
    const double peak = pc.cluster.gpus * pc.cluster.gpu.peak_flops;
    pc.published_mfu = flops / pc.published_step_s / peak;
    pc.predicted_mfu = flops / pc.predicted_step_s / peak;
    pc.predicted_mem_gib = layout_memory(pc.model, pc.cluster, pc.train, pc.layout).total() / kGiB;
    out.push_back(std::move(pc));
  };
  {  // Narayanan et al. 2021 (arXiv:2104.04473), Table 1: 163 TFLOP/s per GPU (52% of peak), counted
     // with their eq. 3, F = 96 B s l h^2 (1 + s / 6h + V / 16 l h), which includes the recomputed forward
    const double B = 1536, s = 2048, l = 96, h = 12288, V = 51200;
    const double F = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h));
    add("Megatron-LM GPT-3 175B, 1024 x A100", "Narayanan et al. 2021, Table 1",
        gpt_shape("gpt3-175b", 96, 12288, 96, 2048, 51200), gpu_spec("a100"), 1024, 1536,
        Layout{16, 8, 8, 1, 0, Recompute::Full, 1}, F / (1024 * 163e12));
  }
  {  // torchtitan docs/performance.md, Table 1: Llama 3.1 8B, 8 H100 (96 GB HBM2e, 2.4 TB/s, 500 W),
     // FSDP, local batch 2 x 8192 tokens, selective activation checkpointing: 5,762 tokens/s per GPU
    GpuSpec h100 = gpu_spec("h100");
    h100.hbm_bytes = 96 * kGiB;
    h100.hbm_bytes_per_s = 2.4e12;
    add("torchtitan Llama 3 8B, 8 x H100 (FSDP)", "torchtitan docs/performance.md, Table 1", llama3_8b_shape(8192),
        h100, 8, 16, Layout{8, 1, 1, 1, 3, Recompute::Selective, 2}, 2.0 * 8192 / 5762, 82.4);
  }
  // llm.c discussion #677 (GPT-2 1558M reproduction): 8 H100 SXM, ZeRO-1, micro-batch 16 x 1024,
  // 1,048,576 tokens per step (gradient accumulation 8), flash attention (cuDNN): ~2.8 s per step
  add("llm.c GPT-2 1.5B, 8 x H100 (ZeRO-1)", "karpathy/llm.c discussion #677",
      gpt_shape("gpt2-1558m", 48, 1600, 25, 1024, 50257), gpu_spec("h100"), 8, 1024,
      Layout{8, 1, 1, 1, 1, Recompute::Selective, 16}, 2.8);
  return out;
}

std::string published_table(const std::vector<PublishedCase>& cases) {
  std::string out =
      "| run | layout | published s/step | predicted s/step | error | published MFU | predicted MFU | "
      "published GiB/GPU | predicted GiB/GPU |\n"
      "|---|---|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const PublishedCase& c : cases)
    out += fmt::format("| {} | {} | {:.2f} | {:.2f} | {:+.0f}% | {:.1f}% | {:.1f}% | {} | {:.1f} |\n", c.name,
                       layout_str(c.layout), c.published_step_s, c.predicted_step_s, 100 * c.relative_error(),
                       100 * c.published_mfu, 100 * c.predicted_mfu,
                       c.published_mem_gib > 0 ? fmt::format("{:.1f}", c.published_mem_gib) : std::string("-"),
                       c.predicted_mem_gib);
  return out;
}

}  // namespace dtrain::parallel
