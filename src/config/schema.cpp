// The recipe schema: every section and key dtrain reads, with type, default, bounds,
// choices and help. This table is the single source of truth for validation, defaults,
// the resolved config.toml, `dtrain train --help-config` and docs/config.md.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <unordered_map>

#include "core/log.h"
#include "config/config.h"
#include "config/toml_values.h"

namespace dtrain {

namespace {

using config_detail::kI32;
using config_detail::kI64;
using config_detail::kInf;

Range ge(double lo, double hi = kI32) { return {lo, hi, false, false}; }
Range gt(double lo) { return {lo, kInf, true, false}; }
Range closed(double lo, double hi) { return {lo, hi, false, false}; }
Range half_open(double lo, double hi) { return {lo, hi, false, true}; }
Range any() { return {}; }

using T = ValueType;

std::vector<KeySpec> build() {
  return {
      // [run]
      {"run.name", T::String, "\"\"", any(), {}, false,
       "run directory name under run.out_dir (default: the recipe's file stem)"},
      {"run.seed", T::Int, "0", ge(0, kI64), {}, false, "seed of every random stream"},
      {"run.device", T::String, "\"auto\"", any(), {"auto", "cpu", "cuda"}, false,
       "auto = CUDA when a device is visible, else CPU"},
      {"run.out_dir", T::String, "\"runs\"", any(), {}, false, "parent of run directories"},
      {"run.threads", T::Int, "0", ge(0, 4096), {}, false, "CPU threads per process (0 = OMP_NUM_THREADS when set, else the CPUs of the process's affinity mask / the ranks on its node)"},
      {"run.cudnn_benchmark", T::Bool, "false", any(), {}, false,
       "CUDA: time cuDNN's convolution algorithms once per shape and keep the fastest (as "
       "torch.backends.cudnn.benchmark); false: cuDNN's heuristic choice, the same every run"},
      // [model]
      {"model.kind", T::String, "\"\"", any(), {"resnet", "unet", "gpt"}, true, "model family"},
      {"model.depth", T::Int, "20", ge(1), {}, false,
       "ResNet depth (CIFAR stem: 6n+2, e.g. 20, 56; ImageNet stem: 18, 34, 50, 101, 152)"},
      {"model.width", T::Int, "0", ge(0), {}, false,
       "channels of the first stage (0 = family default: 16 CIFAR, 64 ImageNet)"},
      {"model.stem", T::String, "\"cifar\"", any(), {"cifar", "imagenet"}, false,
       "cifar = 3x3 conv; imagenet = 7x7/2 conv + 3x3/2 max-pool"},
      {"model.num_classes", T::Int, "10", ge(2), {}, false, "classifier outputs"},
      {"model.in_channels", T::Int, "3", ge(1), {}, false, "input image channels"},
      {"model.zero_init_residual", T::Bool, "false", any(), {}, false,
       "zero the last BatchNorm gamma of each residual block"},
      {"model.sync_bn", T::Bool, "false", any(), {}, false,
       "BatchNorm statistics over all data-parallel ranks"},
      {"model.preset", T::String, "\"\"", any(),
       {"", "tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"}, false,
       "GPT size preset (explicit n_* keys override it)"},
      {"model.n_layer", T::Int, "0", ge(0), {}, false, "GPT transformer blocks (0 = preset)"},
      {"model.n_head", T::Int, "0", ge(0), {}, false, "GPT attention heads (0 = preset)"},
      {"model.n_embd", T::Int, "0", ge(0), {}, false, "GPT embedding width (0 = preset)"},
      {"model.block_size", T::Int, "0", ge(0), {}, false, "GPT context length (0 = preset)"},
      {"model.vocab_size", T::Int, "0", ge(0), {}, false, "GPT vocabulary (0 = preset)"},
      {"model.arch", T::String, "\"gpt2\"", any(), {"gpt2", "llama", "qwen2"}, false,
       "GPT architecture: gpt2 (LayerNorm, learned positions, GELU, tied head); llama (LlamaForCausalLM: "
       "RMSNorm, rotary positions, SwiGLU, grouped-query attention) or qwen2 (Qwen2ForCausalLM: llama's with "
       "q/k/v biases); the model.n_kv_head ... model.mlp_bias keys below are llama / qwen2 only (another value than "
       "their default with gpt2 is refused)"},
      {"model.n_kv_head", T::Int, "0", ge(0), {}, false,
       "llama/qwen2: key/value heads (num_key_value_heads; 0 = model.n_head; 1 = multi-query); divides model.n_head"},
      {"model.head_dim", T::Int, "0", ge(0), {}, false,
       "llama: size of an attention head (0 = model.n_embd / model.n_head); even (rotary); qwen2 has no such "
       "switch (0 or n_embd / n_head)"},
      {"model.intermediate_size", T::Int, "0", ge(0), {}, false,
       "llama/qwen2: SwiGLU hidden width (0 = 4 x model.n_embd, GPT-2's MLP width; Llama's own sizes are about "
       "8/3 x n_embd rounded up: set it)"},
      {"model.rms_norm_eps", T::Float, "1e-6", gt(0), {}, false, "llama/qwen2: RMSNorm epsilon"},
      {"model.rope_theta", T::Float, "10000.0", gt(0), {}, false, "llama/qwen2: rotary base frequency"},
      {"model.rope_scaling", T::String, "\"none\"", any(), {"none", "llama3"}, false,
       "llama/qwen2: rotary frequency scaling: none, or Llama 3.1's (llama3: the model.rope_factor, "
       "rope_low_freq_factor, rope_high_freq_factor and rope_original_max_positions keys)"},
      {"model.rope_factor", T::Float, "8.0", gt(0), {}, false, "llama3 rope scaling: factor"},
      {"model.rope_low_freq_factor", T::Float, "1.0", gt(0), {}, false, "llama3 rope scaling: low_freq_factor"},
      {"model.rope_high_freq_factor", T::Float, "4.0", gt(0), {}, false,
       "llama3 rope scaling: high_freq_factor (> rope_low_freq_factor)"},
      {"model.rope_original_max_positions", T::Int, "8192", ge(1), {}, false,
       "llama3 rope scaling: original_max_position_embeddings"},
      {"model.tie_word_embeddings", T::Bool, "false", any(), {}, false,
       "llama/qwen2: the LM head is embed_tokens (no lm_head.weight); GPT-2 always ties its head ("
       "true is refused with model.arch = \"gpt2\")"},
      {"model.attention_bias", T::Bool, "false", any(), {}, false,
       "llama: biases on q_proj, k_proj, v_proj and o_proj (qwen2 always has q/k/v biases and takes neither key)"},
      {"model.mlp_bias", T::Bool, "false", any(), {}, false, "llama: biases on gate_proj, up_proj and down_proj"},
      {"model.num_local_experts", T::Int, "0", ge(0, 1024), {}, false,
       "mixture of experts: experts per MoE layer (0 = dense MLPs); gpt2: GPT-2 MLPs as experts, llama: "
       "MixtralForCausalLM's block_sparse_moe, qwen2: Qwen2MoeForCausalLM's mlp (docs/moe.md)"},
      {"model.num_experts_per_tok", T::Int, "2", ge(1, 1024), {}, false,
       "mixture of experts: experts each token is routed to (top-k, <= model.num_local_experts)"},
      {"model.moe_intermediate_size", T::Int, "0", ge(0), {}, false,
       "llama/qwen2 mixture of experts: an expert's SwiGLU width (0 = model.intermediate_size)"},
      {"model.moe_every", T::Int, "1", ge(1), {}, false,
       "mixture of experts: block i is MoE when (i + 1) % moe_every == 0 (Qwen2-MoE's decoder_sparse_step; "
       "Mixtral: 1), the others dense"},
      {"model.router_aux_loss_coef", T::Float, "0.001", ge(0, kInf), {}, false,
       "mixture of experts: weight of the load-balancing loss (Switch / Mixtral) added to the training loss"},
      {"model.router_z_loss_coef", T::Float, "0.0", ge(0, kInf), {}, false,
       "mixture of experts: weight of the router z-loss (ST-MoE: mean of logsumexp(router logits)^2)"},
      {"model.capacity_factor", T::Float, "0.0", ge(0, kInf), {}, false,
       "mixture of experts: 0 = dropless; else each expert takes at most ceil(factor * tokens * top_k / experts) "
       "slots per layer and batch, in token order, and the rest are dropped (counted in metrics)"},
      {"model.norm_topk_prob", T::Bool, "true", any(), {}, false,
       "mixture of experts: the top-k gate values divided by their sum (Mixtral: true; Qwen2-MoE's "
       "norm_topk_prob)"},
      {"model.shared_expert_intermediate_size", T::Int, "0", ge(0), {}, false,
       "qwen2 mixture of experts: width of the shared expert every token passes through, gated by a sigmoid "
       "(Qwen2-MoE's shared_expert / shared_expert_gate; 0 = none)"},
      {"model.init_from", T::String, "\"\"", any(), {}, false,
       "start from these weights instead of the seeded initialisation (fine-tuning): a safetensors file with "
       "PyTorch names (dtrain's, torchvision's state_dict), a checkpoint or a run directory; ignored when resuming (except with lora.enabled: the frozen model, read "
       "on every start)"},
      {"model.init_strict", T::Bool, "true", any(), {}, false,
       "model.init_from must hold every tensor of the model with its shape and nothing else; false: missing or "
       "differently shaped tensors (a new classifier) keep their initialisation, extra ones are ignored"},
      {"model.base_channels", T::Int, "64", ge(1), {}, false, "U-Net channels of the first level"},
      {"model.upsample", T::String, "\"transpose\"", any(), {"transpose", "bilinear"}, false,
       "U-Net decoder upsampling"},
      // [data]
      {"data.kind", T::String, "\"webdataset\"", any(), {"webdataset", "synthetic", "tokens", "sft"},
       false, "webdataset = tar shards of images; tokens = llm.c token shards (gpt-2 uint16 or llama-3 uint32); sft = "
       "fine-tuning shards of `dtrain data sft` (one example per document, loss on the completions only); "
       "synthetic = random inputs made once (benchmarks)"},
      {"data.path", T::String, "\"\"", any(), {}, false,
       "dataset directory (required unless data.kind = \"synthetic\")"},
      {"data.prepare", T::String, "\"\"", any(), {}, false,
       "the command that makes data.path (a dtrain data ... line): printed, ready to paste, when "
       "data.path does not exist"},
      {"data.train_split", T::String, "\"train\"", any(), {}, false, "training split name"},
      {"data.eval_split", T::String, "\"test\"", any(), {}, false, "evaluation split name (GPT and U-Net: \"val\" unless set)"},
      {"data.image_size", T::Int, "0", ge(0, 16384), {}, false,
       "resize every image (and mask) so its shorter side is this, then centre-crop to a square of it, as "
       "torchvision's Resize + CenterCrop (0 = the images' own size, which must be one size)"},
      {"data.resize_size", T::Int, "0", ge(0), {}, false,
       "shorter side before the centre crop of data.image_size, e.g. 256 for 224 (0 = data.image_size)"},
      {"data.random_resized_crop", T::Bool, "false", any(), {}, false,
       "training: torchvision's RandomResizedCrop(data.image_size) (area [data.crop_scale_min, 1], ratio 3/4 to "
       "4/3) instead of the resize + centre crop; evaluation keeps the centre crop"},
      {"data.crop_scale_min", T::Float, "0.08", Range{0, 1, true, false}, {}, false,
       "smallest area fraction of data.random_resized_crop's crops"},
      {"data.mean", T::FloatArray, "[]", any(), {}, false,
       "per-channel mean subtracted after scaling to [0,1] ([] = none)"},
      {"data.std", T::FloatArray, "[]", gt(0), {}, false,
       "per-channel std divided by ([] = none; same length as data.mean)"},
      {"data.crop_padding", T::Int, "0", ge(0), {}, false,
       "random crop after zero padding by this many pixels (0 = off)"},
      {"data.hflip", T::Bool, "false", any(), {}, false, "random horizontal flip"},
      {"data.workers", T::Int, "2", ge(0, 256), {}, false, "decoding threads per process"},
      {"data.prefetch", T::Int, "4", ge(1, 1024), {}, false, "batches prepared ahead"},
      {"data.synthetic_height", T::Int, "32", ge(1, 16384), {}, false, "synthetic image height (ResNet, U-Net)"},
      {"data.synthetic_width", T::Int, "32", ge(1, 16384), {}, false, "synthetic image width (ResNet, U-Net)"},
      {"data.packing", T::Bool, "false", any(), {}, false,
       "data.kind = \"sft\": several whole examples per sequence (best-fit decreasing), each attending within "
       "itself, positions restarting at each; false: one example per sequence, padded"},
      {"data.overflow", T::String, "\"refuse\"", any(), {"refuse", "split", "truncate"}, false,
       "data.kind = \"sft\": an example longer than the model's sequence is an error (refuse), cut into "
       "sequence-long pieces (split), or cut to its first tokens (truncate)"},
      // [train]
      {"train.batch_size", T::Int, "128", ge(1), {}, false,
       "samples per micro-batch per process"},
      {"train.max_steps", T::Int, "0", ge(0), {}, false,
       "optimizer steps to run (0 = derive from train.epochs)"},
      {"train.epochs", T::Float, "1.0", ge(0, kInf), {}, false,
       "passes over the training set (used when max_steps = 0)"},
      {"train.grad_accum", T::Int, "1", ge(1), {}, false, "micro-batches per optimizer step"},
      {"train.global_batch", T::Int, "0", ge(0, kI64), {}, false,
       "sequences (or images) per optimizer step over the data-parallel ranks: train.batch_size x "
       "train.grad_accum x data ranks. 0 = that product. Set, it fixes the global batch: train.grad_accum is "
       "derived for the world the run gets. A resume on another number of data ranks keeps the checkpoint's "
       "global batch either way (a line says so), or exits 2 when no whole accumulation gives it"},
      {"train.label_smoothing", T::Float, "0.0", half_open(0, 1), {}, false,
       "cross-entropy label smoothing"},
      {"train.dice_weight", T::Float, "1.0", ge(0, kInf), {}, false,
       "U-Net: loss = cross-entropy + dice_weight * soft Dice loss"},
      {"train.early_stop_patience", T::Int, "0", ge(0), {}, false,
       "stop when this many evaluations in a row (eval.every_steps) did not improve on the best one "
       "(needs checkpoint.keep_best; 0 = off)"},
      {"train.clip_grad_norm", T::Float, "0.0", ge(0, kInf), {}, false,
       "clip the global gradient L2 norm (0 = off)"},
      {"train.cuda_graph", T::Bool, "false", any(), {}, false,
       "CUDA only: replay each micro-batch's forward+loss+backward as a CUDA graph (captured once a "
       "step ran without allocating; not with fp16 or data parallelism)"},
      {"train.recompute", T::String, "\"none\"", any(), {"none", "block", "selective"}, false,
       "activation recomputation per unit (GPT block, ResNet stage, U-Net level): block keeps only each "
       "unit's input and runs its forward again before its backward; selective also keeps GEMM and "
       "convolution outputs and recomputes the element-wise, normalisation and attention ops"},
      // [optim]
      {"optim.name", T::String, "\"sgd\"", any(), {"sgd", "adamw"}, false, "optimizer"},
      {"optim.lr", T::Float, "0.1", gt(0), {}, false, "peak learning rate"},
      {"optim.momentum", T::Float, "0.9", half_open(0, 1), {}, false, "SGD momentum"},
      {"optim.nesterov", T::Bool, "false", any(), {}, false, "SGD Nesterov momentum"},
      {"optim.dampening", T::Float, "0.0", half_open(0, 1), {}, false, "SGD dampening"},
      {"optim.weight_decay", T::Float, "5e-4", ge(0, kInf), {}, false,
       "L2 (SGD) or decoupled (AdamW) weight decay"},
      {"optim.decay_bias_and_norm", T::Bool, "false", any(), {}, false,
       "also decay biases and normalization parameters"},
      {"optim.beta1", T::Float, "0.9", half_open(0, 1), {}, false, "AdamW beta1"},
      {"optim.beta2", T::Float, "0.999", half_open(0, 1), {}, false, "AdamW beta2"},
      {"optim.eps", T::Float, "1e-8", gt(0), {}, false, "AdamW epsilon"},
      // [schedule]
      {"schedule.kind", T::String, "\"constant\"", any(),
       {"constant", "step", "multistep", "cosine", "linear"}, false,
       "learning-rate schedule after warmup (linear: decay to schedule.min_lr at the last step)"},
      {"schedule.warmup_steps", T::Int, "0", ge(0), {}, false, "linear warmup steps"},
      {"schedule.warmup_start_factor", T::Float, "0.0", closed(0, 1), {}, false,
       "warmup starts at lr * this factor"},
      {"schedule.step_size", T::Int, "1000", ge(1), {}, false, "step: decay every N steps"},
      {"schedule.gamma", T::Float, "0.1", gt(0), {}, false, "step/multistep: decay factor"},
      {"schedule.milestones", T::IntArray, "[]", ge(1), {}, false,
       "multistep: increasing steps at which lr *= gamma"},
      {"schedule.min_lr", T::Float, "0.0", ge(0, kInf), {}, false, "cosine, linear: final learning rate"},
      // [precision]
      {"precision.dtype", T::String, "\"fp32\"", any(), {"fp32", "bf16", "fp16"}, false,
       "compute dtype: bf16/fp16 run forward and backward on a cast copy of the weights (master weights, grads and optimizer state stay fp32)"},
      {"precision.tf32", T::Bool, "true", any(), {}, false, "allow TF32 tensor cores for fp32"},
      {"precision.loss_scale", T::Float, "65536.0", gt(0), {}, false,
       "fp16: initial dynamic loss scale"},
      {"precision.growth_interval", T::Int, "2000", ge(1), {}, false,
       "fp16: clean steps before the loss scale doubles"},
      // [parallel]
      {"parallel.backend", T::String, "\"auto\"", any(), {"auto", "gloo", "nccl"}, false,
       "collectives: auto = NCCL on CUDA, Gloo on CPU"},
      {"parallel.zero", T::Int, "0", closed(0, 3), {}, false,
       "ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters (per unit, FSDP); over the data "
       "dimension, so it combines with parallel.tensor and parallel.pipeline"},
      {"parallel.shard_group_size", T::Int, "0", ge(0), {}, false,
       "ZeRO-3 hybrid sharding (FSDP HYBRID_SHARD, ZeRO++ hpZ): shard within groups of this many consecutive ranks "
       "and replicate across the groups (gradients all-reduced between them); must divide the world size; 0 = one "
       "group of all ranks"},
      {"parallel.reduce_dtype", T::String, "\"f32\"", any(), {"f32", "bf16"}, false,
       "dtype the gradients are reduce-scattered in under parallel.zero = 3 (FSDP's reduce_dtype): bf16 halves "
       "the bytes, each pairwise sum rounded to bf16; the result is added into the f32 gradient shard. Needs "
       "parallel.zero = 3 when bf16"},
      {"parallel.tensor", T::Int, "1", ge(1), {}, false,
       "tensor parallelism (Megatron, GPT only): each attention/MLP layer and the vocabulary split over this many "
       "consecutive ranks; must divide the world size (world = pipeline x data x tensor) and model.n_head"},
      {"parallel.sequence", T::Bool, "false", any(), {}, false,
       "sequence parallelism (Megatron, with parallel.tensor > 1): the layer norms and residual adds between the "
       "tensor-parallel layers run on each rank's block of the batch's B*T token rows (all-gathered before a "
       "column-parallel layer, reduce-scattered after a row-parallel one: the all-reduce's bytes, 1/tensor of the "
       "activation memory there); parallel.tensor must divide model.block_size"},
      {"parallel.pipeline", T::Int, "1", ge(1), {}, false,
       "pipeline parallelism (GPT only): the transformer blocks split into this many stages on ranks strided by "
       "data x tensor (world = pipeline x data x tensor); the embedding on the first stage, ln_f and the tied head "
       "on the last; the train.grad_accum micro-batches flow through them"},
      {"parallel.schedule", T::String, "\"1f1b\"", any(), {"1f1b", "gpipe"}, false,
       "pipeline schedule: 1f1b (one forward one backward, at most pipeline - stage micro-batches in flight; "
       "interleaved with parallel.virtual_stages > 1) or gpipe (every forward, then every backward)"},
      {"parallel.virtual_stages", T::Int, "1", ge(1), {}, false,
       "interleaved 1F1B (Megatron): model chunks per pipeline rank; needs train.grad_accum divisible by "
       "parallel.pipeline and model.n_layer by pipeline x virtual_stages (unless parallel.stage_layers is set)"},
      {"parallel.stage_layers", T::IntArray, "[]", ge(1), {}, false,
       "pipeline: the blocks of each stage (pipeline x virtual_stages entries summing to model.n_layer); empty: "
       "balanced by cost"},
      {"parallel.bucket_mb", T::Float, "25.0", gt(0), {}, false, "gradient bucket size (MiB)"},
      {"parallel.grad_compression", T::String, "\"none\"", any(), {"none", "bf16", "fp16", "powersgd"}, false,
       "compression of the data-parallel gradient all-reduce (PyTorch's DDP communication hooks): bf16/fp16 cast "
       "each bucket to 16 bits, all-reduce it in 16 bits and cast back (half the bytes); powersgd sends a rank-"
       "parallel.powersgd_rank approximation P Q^T of each gradient matrix, with error feedback (vectors and small "
       "matrices go uncompressed). Needs parallel.zero 0 or 1 and parallel.tensor = 1; one process ignores it"},
      {"parallel.powersgd_rank", T::Int, "1", ge(1), {}, false,
       "powersgd: the rank r of each compressed gradient matrix (r = min(r, rows, cols)); (rows + cols) r floats "
       "travel instead of rows x cols"},
      {"parallel.powersgd_start_step", T::Int, "0", ge(0), {}, false,
       "powersgd: plain f32 all-reduces for the steps before this one (PyTorch's start_powerSGD_iter warm-up)"},
      {"parallel.offload", T::String, "\"none\"", any(), {"none", "optimizer"}, false,
       "optimizer = ZeRO-Offload: the f32 master weights and optimizer state (of the rank's ZeRO shard) live in "
       "host memory (pinned on CUDA) and the update runs on the CPU, the gradients and new weights copied in "
       "chunks that overlap the update; the device keeps only the weights and gradients"},
      {"parallel.offload_chunk_mb", T::Float, "16.0", gt(0), {}, false,
       "offload: f32 MiB per chunk of the copy/update pipeline"},
      {"parallel.timeout_s", T::Int, "300", ge(1), {}, false,
       "rendezvous and collective timeout (seconds)"},
      {"parallel.job_id", T::String, "\"\"", any(), {}, false,
       "rendezvous id shared by all ranks (\"\" = derived)"},
      // [lora]
      {"lora.enabled", T::Bool, "false", any(), {}, false,
       "LoRA fine-tuning (docs/finetune.md): the model of model.init_from stays frozen and only low-rank adapters "
       "of lora.target_modules are trained (their gradients, optimizer state, ZeRO shards and checkpoints); "
       "checkpoints also hold adapter_model.safetensors and adapter_config.json in PEFT's layout"},
      {"lora.rank", T::Int, "8", ge(1), {}, false, "the adapters' rank r (PEFT's r): lora_A [r, in], lora_B [out, r]"},
      {"lora.alpha", T::Float, "16.0", gt(0), {}, false, "PEFT's lora_alpha: the update is scaled by alpha / rank"},
      {"lora.dropout", T::Float, "0.0", half_open(0, 1), {}, false,
       "PEFT's lora_dropout on the adapters' input (only 0 is implemented: another value is refused)"},
      {"lora.target_modules", T::String, "\"\"", any(), {}, false,
       "comma-separated Hugging Face module names that get adapters: q_proj, k_proj, v_proj, o_proj, gate_proj, "
       "up_proj, down_proj (llama / qwen2); c_attn, c_proj, c_fc (gpt2; c_proj is the attention's and the MLP's)"},
      // [checkpoint]
      {"checkpoint.every_steps", T::Int, "0", ge(0), {}, false,
       "checkpoint interval (0 = only at the end)"},
      {"checkpoint.keep_last", T::Int, "3", ge(1), {}, false, "checkpoints kept"},
      {"checkpoint.keep_best", T::Bool, "false", any(), {}, false,
       "also keep the checkpoint with the best evaluation (accuracy, mIoU, or the lowest val loss for GPT), named "
       "by checkpoints/best.json; an evaluation that improves on it saves a checkpoint at its step"},
      {"checkpoint.async", T::Bool, "false", any(), {}, false,
       "periodic checkpoints: write the files on the training thread, then fsync, checksum and rename them "
       "on a background thread while training goes on (with data parallelism every rank writes its files, then "
       "rank 0 commits them in the background)"},
      // [eval]
      {"eval.every_steps", T::Int, "0", ge(0), {}, false, "evaluation interval (0 = only at the end)"},
      {"eval.batch_size", T::Int, "256", ge(1), {}, false, "evaluation batch size per process"},
      {"eval.max_batches", T::Int, "0", ge(0), {}, false, "batches per evaluation (0 = all)"},
      // [log]
      {"log.every_steps", T::Int, "10", ge(1), {}, false, "console/metrics interval (steps)"},
      {"log.tensorboard", T::Bool, "true", any(), {}, false, "write TensorBoard event files"},
      {"log.level", T::String, "\"info\"", any(), {"info", "debug", "warn"}, false,
       "messages shown besides the step and eval lines: debug, info (checkpoints, setup) or warn (warnings and "
       "errors only)"},
      // [observability]
      {"observability.prometheus_port", T::Int, "0", closed(0, 65535), {}, false,
       "serve Prometheus /metrics on this port (0 = off)"},
      {"observability.bind", T::String, "\"127.0.0.1\"", any(), {}, false,
       "address the metrics endpoint listens on"},
      {"observability.peak_tflops", T::Float, "0.0", ge(0, kInf), {}, false,
       "device peak TFLOP/s for MFU (0 = from the device table)"},
      // [expect] (dtrain reproduce)
      {"expect.metric", T::String, "\"\"", any(), {}, false,
       "the evaluation metric the recipe promises (\"\" = none): eval_loss (any model), eval_accuracy or "
       "eval_accuracy_top5 (resnet), eval_miou, eval_dice or eval_pixel_accuracy (unet); eval_loss is reached at or "
       "below the target, the others at or above it"},
      {"expect.target", T::Float, "0.0", any(), {}, false, "the promised value of expect.metric"},
      {"expect.tolerance", T::Float, "0.0", ge(0, kInf), {}, false,
       "how far short of the target still counts as reproduced (absolute, in the metric's units)"},
      {"expect.budget_steps", T::Int, "0", ge(0), {}, false,
       "the target must be reached by this step (0 = by the end of the recipe)"},
      {"expect.budget_s", T::Float, "0.0", ge(0, kInf), {}, false,
       "the target must be reached within this many seconds of training (the run's wall time at that evaluation; "
       "0 = no time budget)"},
      {"expect.hardware", T::String, "\"\"", any(), {}, false,
       "where the expected result was measured (e.g. \"2-core AMD EPYC, Debian 12\")"},
      {"expect.reference", T::String, "\"\"", any(), {}, false,
       "reference curve: a metrics.jsonl of a committed run (e.g. configs/reference/NAME.jsonl), relative to the "
       "working directory; its eval metric and throughput are compared, and charts draw it dashed"},
  };
}

}  // namespace

const std::vector<KeySpec>& config_schema() {
  static const std::vector<KeySpec> schema = build();
  return schema;
}

int config_schema_index(std::string_view key) {
  static const std::unordered_map<std::string_view, int> index = [] {
    std::unordered_map<std::string_view, int> m;
    const auto& s = config_schema();
    for (size_t i = 0; i < s.size(); ++i) m.emplace(s[i].key, int(i));
    return m;
  }();
  auto it = index.find(key);
  return it == index.end() ? -1 : it->second;
}

std::vector<std::string_view> config_sections() {
  std::vector<std::string_view> out;
  for (const auto& k : config_schema()) {
    auto sec = k.key.substr(0, k.key.find('.'));
    if (out.empty() || out.back() != sec) out.push_back(sec);
  }
  return out;
}

}  // namespace dtrain
