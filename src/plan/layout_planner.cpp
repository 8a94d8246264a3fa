// The layout planner's model: memory, step time and constraints of one layout, and the
// enumeration (plan/layout_planner.h; docs/scaling.md, "Layout planner", has the equations).
#include "plan/layout_planner.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "models/gpt.h"
#include "plan/scaling.h"

namespace dtrain::parallel {

namespace {

constexpr double kGiB = double(int64_t(1) << 30);
// The width at which a bf16 GEMM reaches half its best efficiency: eff(w) = max_eff * w / (w + kGemmHalfWidth),
// w = the smallest GEMM dimension a GPU sees (n_embd / tp, or the micro-batch's tokens).
constexpr double kGemmHalfWidth = 256;
// Each stored activation byte (the selective-recompute set, 34 s b h for GPT) moves this many times
// through HBM in the memory-bound kernels (layer norm, GELU, softmax, residual adds, dropout): written
// in forward, read in backward, its gradient written and read once.
constexpr double kElementwisePasses = 4;
// The share of a compute window that hides data-parallel communication (kernels share SMs and HBM).
constexpr double kOverlap = 0.8;
// Optimizer step: bytes per optimized parameter (read fp32 gradient, master, two moments; write
// master, moments and the bf16 weight).
constexpr double kOptimizerBytesPerParam = 30;
// Per GPU, memory a layout cannot use: CUDA context and NCCL buffers, and allocator fragmentation.
constexpr double kReserveFixed = 2 * kGiB;
constexpr double kReserveFraction = 0.08;
// Bounds on the search (its layouts are held in memory, each with its reason).
constexpr int kMaxGpus = 1 << 20;
constexpr int64_t kMaxBatch = int64_t(1) << 30;
constexpr double kMaxLayouts = 2e6;

double gemm_eff(const GpuSpec& g, double width) { return g.gemm_max_eff * width / (width + kGemmHalfWidth); }

// All-reduce of `bytes` over a group of n GPUs with g of them in each node: a ring inside a node,
// hierarchical above (plan/scaling.h), a flat ring over the inter-node link when n is not a
// multiple of g.
double group_allreduce_s(double bytes, int n, int g, const Cluster& c) {
  const LinkModel intra{"intra", c.intra_alpha_s, c.gpu.intra_bytes_per_s};
  const LinkModel inter{"inter", c.inter_alpha_s, c.gpu.inter_bytes_per_s};
  if (n <= 1) return 0;
  g = std::max(1, g);
  if (n <= g) return ring_allreduce_s(bytes, n, intra);
  if (n % g != 0 || g == 1) return ring_allreduce_s(bytes, n, inter);
  return allreduce_s(bytes, n, inter, intra, g);
}

// Bytes of one layer's stored activations per token (Korthikanti et al. 2022, Table 2, 2-byte
// activations): attention 11h (7h + 4 h_kv with grouped-query attention), MLP 2h + 2F per
// intermediate + h (GELU: 2 intermediates, 19h at F = 4h; SwiGLU: 3), two norms' inputs 4h.
double act_bytes_per_token(const ModelShape& m) {
  const double h = m.n_embd, hkv = double(m.n_embd) * m.kv_heads / m.n_head;
  const double attn = 7 * h + 4 * hkv;
  const double mlp = 2 * h + 2.0 * m.ffn_hidden * (m.ffn_mats == 3 ? 3 : 2) + h;
  return attn + mlp + 4 * h;
}

int micro_batches(const TrainShape& t, const Layout& l) {
  return int(t.global_batch / (int64_t(l.dp) * l.mbs));
}

// The parameters of the first and the last pipeline stage (one GPU's share is / tp).
struct StageParams {
  double first = 0, last = 0;
};
StageParams stage_params(const ModelShape& m, const Layout& l) {
  const double layers = double(m.n_layer) / l.pp * double(m.layer_params);
  if (l.pp == 1) return {double(m.params()), double(m.params())};
  // Megatron: the last stage holds its own copy of a tied LM head
  const double head = m.tied_head ? double(m.vocab) * m.n_embd : double(m.head_params);
  return {layers + double(m.embed_params), layers + head};
}

}  // namespace

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::None: return "none";
    case Recompute::Selective: return "selective";
    case Recompute::Full: return "full";
  }
  return "?";
}

ModelShape gpt_shape(const std::string& name, int n_layer, int n_embd, int n_head, int seq, int vocab) {
  GptSpec s;
  s.preset = name;
  s.n_layer = n_layer, s.n_embd = n_embd, s.n_head = n_head, s.block_size = seq, s.vocab_size = vocab;
  s.padded_vocab = 0;
  gpt_validate(s);
  ModelShape m;
  m.name = name;
  m.n_layer = n_layer, m.n_embd = n_embd, m.n_head = n_head, m.kv_heads = n_head;
  m.ffn_hidden = 4 * n_embd, m.ffn_mats = 2;
  m.vocab = s.padded_vocab, m.seq = seq, m.tied_head = true;
  m.embed_params = (m.vocab + seq) * int64_t(n_embd);
  m.head_params = 2 * int64_t(n_embd);  // final layer norm
  const int64_t total = gpt_param_count(s, true);
  m.layer_params = (total - m.embed_params - m.head_params) / n_layer;
  if (m.params() != total) fault("gpt_shape: {} parameters do not split into {} equal layers", total, n_layer);
  return m;
}

ModelShape llama3_8b_shape(int seq) {
  ModelShape m;
  m.name = "llama3-8b";
  m.n_layer = 32, m.n_embd = 4096, m.n_head = 32, m.kv_heads = 8;
  m.ffn_hidden = 14336, m.ffn_mats = 3;
  m.vocab = 128256, m.seq = seq, m.tied_head = false;
  const int64_t h = m.n_embd, hkv = h * m.kv_heads / m.n_head;
  m.layer_params = h * h * 2 + 2 * h * hkv + 3 * h * m.ffn_hidden + 2 * h;  // q, o, k, v, MLP, two RMSNorms
  m.embed_params = m.vocab * h;
  m.head_params = m.vocab * h + h;  // output projection, final norm
  return m;
}

ModelShape model_shape(const std::string& name, const GptSpec& spec) {
  if (spec.family != "llama") {
    ModelShape m = gpt_shape(name, spec.n_layer, spec.n_embd, spec.n_head, spec.block_size, spec.vocab_size);
    if (spec.moe.enabled()) {  // expert MLPs: the blocks averaged, the remainder with the head
      GptSpec s = spec;
      gpt_validate(s);
      const int64_t total = gpt_param_count(s, true);
      m.layer_params = (total - m.embed_params - m.head_params) / m.n_layer;
      m.head_params += total - m.params();
    }
    return m;
  }
  GptSpec s = spec;
  gpt_validate(s);  // fills n_layer, n_embd, n_head, block_size and the padded vocabulary from s.llama
  const LlamaConfig& c = s.llama;
  ModelShape m;
  m.name = name;
  m.n_layer = s.n_layer, m.n_embd = s.n_embd, m.n_head = s.n_head, m.kv_heads = c.kv_heads();
  m.ffn_hidden = c.intermediate_size, m.ffn_mats = 3;
  m.vocab = s.padded_vocab, m.seq = s.block_size, m.tied_head = c.tie_word_embeddings;
  const int64_t h = s.n_embd;
  m.embed_params = m.vocab * h;                           // embed_tokens (rotary positions: no table)
  m.head_params = (m.tied_head ? 0 : m.vocab * h) + h;  // an untied lm_head, the final RMSNorm
  const int64_t total = gpt_param_count(s, true);
  m.layer_params = (total - m.embed_params - m.head_params) / m.n_layer;
  // a mixture of experts every moe_every-th block: the blocks averaged, the remainder with the head
  if (s.moe.enabled() && s.moe.every > 1) m.head_params += total - m.params();
  if (m.params() != total) fault("model_shape: {} parameters do not split into {} equal layers", total, m.n_layer);
  return m;
}

double model_flops_per_token(const ModelShape& m) {
  return 3.0 * transformer_forward_flops_per_token(double(m.params()), m.n_layer, m.n_embd, m.seq);
}

// Sources: NVIDIA data sheets (peak dense bf16 tensor FLOP/s, memory, bandwidth, NVLink per
// direction); per-GPU bus bandwidth as nccl-tests all_reduce reports it on DGX/HGX-class nodes
// (NVLink below the per-direction spec; InfiniBand: one NIC per GPU, NDR 400 Gb/s = 50 GB/s for
// H100/H200, HDR 200 Gb/s = 25 GB/s for A100, both derated ~10%); best bf16 GEMM efficiency from
// published GEMM sweeps (S. Bekman, "ML Engineering", MAMF finder: H100 SXM ~80%, A100 SXM ~86%).
// The peaks equal obs/peak_flops.cpp's table (a test checks it).
GpuSpec gpu_spec(const std::string& name) {
  if (name == "h100") return {"h100", 989e12, 80 * kGiB, 3.35e12, 360e9, 45e9, 0.80};
  if (name == "h200") return {"h200", 989e12, 141 * kGiB, 4.8e12, 360e9, 45e9, 0.80};
  if (name == "a100") return {"a100", 312e12, 80 * kGiB, 2.039e12, 230e9, 22e9, 0.86};
  if (name == "a100-40gb") return {"a100-40gb", 312e12, 40 * kGiB, 1.555e12, 230e9, 22e9, 0.86};
  // L40S: no NVLink (PCIe 4.0 x16, 32 GB/s per direction), 200 Gb/s networking; GEMM efficiency
  // an estimate (the card is power-limited), not a measurement.
  if (name == "l40s") return {"l40s", 362e12, 48 * kGiB, 0.864e12, 20e9, 20e9, 0.65};
  std::string names;
  for (const std::string& n : gpu_names()) names += (names.empty() ? "" : ", ") + n;
  user_error("--gpu {}: expected one of {}", name, names);
}

std::vector<std::string> gpu_names() { return {"h100", "h200", "a100", "a100-40gb", "l40s"}; }

double bubble_fraction(int pp, int v, int micro_batches) {
  if (pp <= 1 || micro_batches < 1) return 0;
  return double(pp - 1) / (double(v) * micro_batches);
}

MemoryBreakdown layout_memory(const ModelShape& m, const Cluster& c, const TrainShape& t, const Layout& l) {
  MemoryBreakdown out;
  const StageParams sp = stage_params(m, l);
  const int M = std::max(1, micro_batches(t, l));
  const double tokens = double(l.mbs) * m.seq;  // per micro-batch
  const double per_layer_selective = act_bytes_per_token(m) * tokens / l.tp;
  double per_layer = per_layer_selective;  // activations of one layer, one micro-batch, one GPU
  if (l.recompute == Recompute::None)      // the s x s scores, softmax and dropout: 5 a s^2 b
    per_layer += 5.0 * m.n_head * double(m.seq) * m.seq * l.mbs / l.tp;
  if (l.recompute == Recompute::Full) per_layer = 2.0 * m.n_embd * tokens / l.tp;  // the layer's input
  const double layers = double(m.n_layer) / l.pp;
  // 1F1B: stage 0 holds min(M, P) micro-batches; interleaved, x (1 + (P-1)/(P V))
  double in_flight = std::min(M, l.pp);
  if (l.v > 1) in_flight *= 1.0 + double(l.pp - 1) / (double(l.pp) * l.v);
  const double recompute_work = l.recompute == Recompute::Full ? per_layer_selective : 0;
  const double act_first = layers * per_layer * in_flight + recompute_work;
  // the last stage: one micro-batch in flight, and the logits (bf16 and their fp32 softmax / gradient)
  const double act_last = layers * per_layer + recompute_work + 6.0 * tokens * double(m.vocab) / l.tp;
  const double first_total = sp.first, last_total = sp.last;
  // the stage with more bytes
  auto state = [&](double params) {
    const double p = params / l.tp;
    const double opt = (4.0 + 4.0 * t.optimizer_states) * p;  // fp32 master + states
    MemoryBreakdown s;
    s.weights = l.zero >= 3 ? 2 * p / l.dp : 2 * p;
    s.grads = l.zero >= 2 ? 4 * p / l.dp : 4 * p;
    s.optimizer = l.zero >= 1 ? opt / l.dp : opt;
    if (l.zero >= 3) s.zero_buffers = 2 * 2.0 * double(m.layer_params) / l.tp;  // two gathered layers
    return s;
  };
  MemoryBreakdown a = state(first_total), b = state(last_total);
  a.activations = act_first;
  b.activations = act_last;
  out = a.total() >= b.total() ? a : b;
  out.reserve = kReserveFixed + kReserveFraction * c.gpu.hbm_bytes;
  return out;
}

StepTime layout_time(const ModelShape& m, const Cluster& c, const TrainShape& t, const Layout& l) {
  StepTime st;
  const GpuSpec& g = c.gpu;
  const int M = std::max(1, micro_batches(t, l));
  const double tokens = double(l.mbs) * m.seq;
  const double layers = double(m.n_layer) / l.pp;
  const double eff = gemm_eff(g, std::min(double(m.n_embd) / l.tp, tokens));
  // one layer, one micro-batch: GEMMs (6 x weights x tokens) and attention (12 h s x tokens,
  // counted over the full sequence; flash attention runs the causal half, the naive attention of
  // recompute = none all of it), each forward a third of it; recompute repeats a forward.
  const double gemm_fwd = 2.0 * double(m.layer_params) * tokens / l.tp;
  const double attn_fwd = 4.0 * double(m.n_embd) * m.seq * tokens / l.tp *
                          (l.recompute == Recompute::None ? 1.0 : 0.5);
  double flops = 3 * (gemm_fwd + attn_fwd);
  if (l.recompute == Recompute::Full) flops += gemm_fwd + attn_fwd;
  if (l.recompute == Recompute::Selective) flops += attn_fwd;
  const double elem_bytes = kElementwisePasses * act_bytes_per_token(m) * tokens / l.tp *
                            (l.recompute == Recompute::Full ? 1.25 : 1.0);
  const double layer_compute = flops / (g.peak_flops * eff) + elem_bytes / g.hbm_bytes_per_s;
  // tensor parallel (sequence parallel): per layer 2 all-gathers + 2 reduce-scatters forward and
  // backward of the tokens x h activations, as much as 4 all-reduces; full recompute 2 more
  const double act_msg = 2.0 * tokens * m.n_embd;
  const double tp_layer = (l.recompute == Recompute::Full ? 6 : 4) * group_allreduce_s(act_msg, l.tp, l.tp, c);
  // the LM head (its GEMM, 6 V h per token) on the last stage
  const double head = 6.0 * double(m.vocab) * m.n_embd * tokens / l.tp / (g.peak_flops * eff);
  const double mb_compute = layers * layer_compute + head;  // the slowest (last) stage
  const double mb_tp = layers * tp_layer;
  st.compute = M * mb_compute;
  st.tp_comm = M * mb_tp;
  st.bubble = double(l.pp - 1) / l.v * (mb_compute + mb_tp);
  // pipeline sends: forward and backward, each chunk, every micro-batch (sequence-parallel shards)
  if (l.pp > 1) {
    const bool across = int64_t(l.tp) * l.dp >= c.gpus_per_node;
    const double bw = across ? g.inter_bytes_per_s : g.intra_bytes_per_s;
    const double alpha = across ? c.inter_alpha_s : c.intra_alpha_s;
    st.p2p = 2.0 * l.v * M * (alpha + act_msg / l.tp / bw);
  }
  // data parallel over dp GPUs, gpus_per_node / tp of them in a node
  const StageParams sp = stage_params(m, l);
  const double p = std::max(sp.first, sp.last) / l.tp;
  const int in_node = std::max(1, c.gpus_per_node / l.tp);
  const double ar_grad = group_allreduce_s(4 * p, l.dp, in_node, c);  // fp32 gradients
  const double rs_grad = ar_grad / 2, ag_param = group_allreduce_s(2 * p, l.dp, in_node, c) / 2;
  const double mb_fwd = mb_compute / 3, mb_bwd = mb_compute - mb_fwd;
  auto exposed = [](double comm, double window) { return std::max(0.0, comm - kOverlap * window); };
  if (l.dp > 1) {
    switch (l.zero) {
      case 0:  // all-reduce during the last micro-batch's backward
        st.dp_comm = ar_grad;
        st.dp_exposed = exposed(ar_grad, mb_bwd);
        break;
      case 1:  // reduce-scatter in the last backward, all-gather of the weights in the first forward
        st.dp_comm = rs_grad + ag_param;
        st.dp_exposed = exposed(rs_grad, mb_bwd) + exposed(ag_param, mb_fwd);
        break;
      case 2:  // gradients reduce-scattered every micro-batch
        st.dp_comm = M * rs_grad + ag_param;
        st.dp_exposed = M * exposed(rs_grad, mb_bwd) + exposed(ag_param, mb_fwd);
        break;
      default:  // weights gathered for forward and again for backward, every micro-batch
        st.dp_comm = M * (2 * ag_param + rs_grad);
        st.dp_exposed = M * (exposed(ag_param, mb_fwd) + exposed(ag_param + rs_grad, mb_bwd));
    }
  }
  const double optimized = l.zero >= 1 ? p / l.dp : p;
  st.optimizer = kOptimizerBytesPerParam * optimized / g.hbm_bytes_per_s;
  return st;
}

Evaluated evaluate(const ModelShape& m, const Cluster& c, const TrainShape& t, const Layout& l) {
  Evaluated e;
  e.layout = l;
  auto fail = [&](const char* reason, std::string words) {
    e.reason = reason;
    e.excluded = std::move(words);
    return e;
  };
  if (int64_t(l.dp) * l.tp * l.pp != c.gpus)
    return fail("dp*tp*pp != N", fmt::format("tp {} x pp {} does not divide {} GPUs", l.tp, l.pp, c.gpus));
  if (m.n_head % l.tp != 0 || m.kv_heads % l.tp != 0)
    return fail("tp divides heads", fmt::format("tp {} does not divide {} heads ({} key/value heads)", l.tp,
                                                m.n_head, m.kv_heads));
  if (l.tp > c.gpus_per_node)
    return fail("tp <= gpus/node",
                fmt::format("tp {} > {} GPUs per node (every layer's all-reduces would cross the network)",
                            l.tp, c.gpus_per_node));
  if (m.n_layer % l.pp != 0)
    return fail("pp divides layers", fmt::format("pp {} does not divide {} layers", l.pp, m.n_layer));
  e.micro_batches = micro_batches(t, l);
  if (t.global_batch % (int64_t(l.dp) * l.mbs) != 0)
    return fail("batch divisible", fmt::format("global batch {} is not a multiple of dp {} x mbs {}",
                                               t.global_batch, l.dp, l.mbs));
  if (l.v > 1 && (l.pp == 1 || (m.n_layer / l.pp) % l.v != 0 || e.micro_batches % l.pp != 0))
    return fail("interleaving",
                fmt::format("v {} needs pp > 1, v dividing the {} layers per stage and micro-batches ({}) a "
                            "multiple of pp {}", l.v, m.n_layer / l.pp, e.micro_batches, l.pp));
  if (l.zero > 0 && l.dp == 1) return fail("zero needs dp > 1", "ZeRO shards over dp = 1: the same as zero 0");
  if (l.zero >= 2 && l.pp > 1)
    return fail("zero 2/3 with pp",
                fmt::format("ZeRO-{} with pp {}: not ranked (the time model's ZeRO-2/3 reduce-scatter gradients, "
                            "and ZeRO-3 gathers weights, for every micro-batch, as DeepSpeed's do, which refuses "
                            "the combination; dtrain trains it; ZeRO-1 with pp shards the optimizer without that "
                            "traffic)", l.zero, l.pp));
  e.mem = layout_memory(m, c, t, l);
  e.time = layout_time(m, c, t, l);
  const double step = e.time.total();
  const double tokens = double(t.global_batch) * m.seq;
  e.tokens_per_s_per_gpu = tokens / step / c.gpus;
  e.mfu = e.tokens_per_s_per_gpu * model_flops_per_token(m) / c.gpu.peak_flops;
  if (e.mem.total() > c.gpu.hbm_bytes)
    return fail("memory", fmt::format("{:.1f} GiB > {:.1f} GiB of {}", e.mem.total() / kGiB,
                                      c.gpu.hbm_bytes / kGiB, c.gpu.name));
  return e;
}

Plan plan_layouts(const ModelShape& m, const Cluster& c, const TrainShape& t) {
  if (c.gpus < 1 || c.gpus > kMaxGpus) user_error("--gpus {}: expected 1 to {}", c.gpus, kMaxGpus);
  if (c.gpus_per_node < 1) user_error("--gpus-per-node {}: expected at least 1", c.gpus_per_node);
  if (t.global_batch < 1 || t.global_batch > kMaxBatch)
    user_error("--global-batch {}: expected 1 to {} sequences", t.global_batch, kMaxBatch);
  if (t.max_mbs < 1 || t.max_mbs > kMaxBatch) user_error("--max-mbs {}: expected 1 to {}", t.max_mbs, kMaxBatch);
  if (c.gpu.intra_bytes_per_s <= 0 || c.gpu.inter_bytes_per_s <= 0)
    user_error("--intra-gbps / --inter-gbps: expected bandwidths above 0");
  Plan p;
  p.model = m, p.cluster = c, p.train = t;
  std::vector<int> divisors;
  for (int d = 1; d <= c.gpus; ++d)
    if (c.gpus % d == 0) divisors.push_back(d);
  int mbs_choices = 0;
  for (int64_t mbs = 1; mbs <= t.max_mbs; mbs *= 2) ++mbs_choices;
  const double layouts = double(divisors.size()) * double(divisors.size()) * 4 * 4 * 3 * mbs_choices;
  if (layouts > kMaxLayouts)
    user_error("--gpus {}: {} divisors make {:.0f} layouts to evaluate, more than {:.0f} (pick a GPU count with "
               "fewer divisors, e.g. a multiple of --gpus-per-node that is a power of two)",
               c.gpus, divisors.size(), layouts, kMaxLayouts);
  for (int tp : divisors)
    for (int pp : divisors) {
      const int64_t cells = int64_t(tp) * pp;  // int64: 65536 x 65536 wrapped to 0 in int
      const int dp = (int64_t(c.gpus) % cells == 0) ? int(int64_t(c.gpus) / cells) : 0;
      for (int v : {1, 2, 4, 8})
        for (int zero = 0; zero <= 3; ++zero)
          for (Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full})
            for (int64_t mbs = 1; mbs <= t.max_mbs; mbs *= 2) {
              Evaluated e = evaluate(m, c, t, Layout{dp, tp, pp, v, zero, r, int(mbs)});
              (e.reason.empty() ? p.feasible : p.excluded).push_back(std::move(e));
            }
    }
  std::stable_sort(p.feasible.begin(), p.feasible.end(), [](const Evaluated& a, const Evaluated& b) {
    const double ta = a.time.total(), tb = b.time.total();
    return ta != tb ? ta < tb : a.mem.total() < b.mem.total();
  });
  return p;
}

}  // namespace dtrain::parallel
