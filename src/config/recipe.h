#pragma once
// The recipe, typed: one struct per TOML section, one field per schema key (schema.cpp).
// Config::load/parse fill it once from the validated TOML; code outside config/ reads these
// fields (cfg.train.batch_size), never a key string. recipe.cpp's field table binds each
// field to its schema key and a test checks that the two agree in name and type.
#include <cstdint>
#include <string>
#include <vector>

namespace dtrain {

struct RunSection {
  std::string name;
  int64_t seed = 0;
  std::string device;
  std::string out_dir;
  int64_t threads = 0;
  bool cudnn_benchmark = false;
};

struct ModelSection {
  std::string kind;
  int64_t depth = 0;
  int64_t width = 0;
  std::string stem;
  int64_t num_classes = 0;
  int64_t in_channels = 0;
  bool zero_init_residual = false;
  bool sync_bn = false;
  std::string preset;
  int64_t n_layer = 0;
  int64_t n_head = 0;
  int64_t n_embd = 0;
  int64_t block_size = 0;
  int64_t vocab_size = 0;
  std::string arch;
  int64_t n_kv_head = 0;
  int64_t head_dim = 0;
  int64_t intermediate_size = 0;
  double rms_norm_eps = 0;
  double rope_theta = 0;
  std::string rope_scaling;
  double rope_factor = 0;
  double rope_low_freq_factor = 0;
  double rope_high_freq_factor = 0;
  int64_t rope_original_max_positions = 0;
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  bool mlp_bias = false;
  int64_t num_local_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  int64_t moe_every = 0;
  double router_aux_loss_coef = 0;
  double router_z_loss_coef = 0;
  double capacity_factor = 0;
  bool norm_topk_prob = false;
  int64_t shared_expert_intermediate_size = 0;
  std::string init_from;
  bool init_strict = false;
  int64_t base_channels = 0;
  std::string upsample;
};

struct DataSection {
  std::string kind;
  std::string path;
  std::string prepare;
  std::string train_split;
  std::string eval_split;
  int64_t image_size = 0;
  int64_t resize_size = 0;
  bool random_resized_crop = false;
  double crop_scale_min = 0;
  std::vector<double> mean;
  std::vector<double> std;
  int64_t crop_padding = 0;
  bool hflip = false;
  int64_t workers = 0;
  int64_t prefetch = 0;
  int64_t synthetic_height = 0;
  int64_t synthetic_width = 0;
  bool packing = false;
  std::string overflow;
};

struct TrainSection {
  int64_t batch_size = 0;
  int64_t max_steps = 0;
  double epochs = 0;
  int64_t grad_accum = 0;
  int64_t global_batch = 0;
  double label_smoothing = 0;
  double dice_weight = 0;
  int64_t early_stop_patience = 0;
  double clip_grad_norm = 0;
  bool cuda_graph = false;
  std::string recompute;
};

struct OptimSection {
  std::string name;
  double lr = 0;
  double momentum = 0;
  bool nesterov = false;
  double dampening = 0;
  double weight_decay = 0;
  bool decay_bias_and_norm = false;
  double beta1 = 0;
  double beta2 = 0;
  double eps = 0;
};

struct ScheduleSection {
  std::string kind;
  int64_t warmup_steps = 0;
  double warmup_start_factor = 0;
  int64_t step_size = 0;
  double gamma = 0;
  std::vector<int64_t> milestones;
  double min_lr = 0;
};

struct PrecisionSection {
  std::string dtype;
  bool tf32 = false;
  double loss_scale = 0;
  int64_t growth_interval = 0;
};

struct ParallelSection {
  std::string backend;
  int64_t zero = 0;
  int64_t shard_group_size = 0;
  std::string reduce_dtype;
  int64_t tensor = 0;
  bool sequence = false;
  int64_t pipeline = 0;
  std::string schedule;
  int64_t virtual_stages = 0;
  std::vector<int64_t> stage_layers;
  double bucket_mb = 0;
  std::string grad_compression;
  int64_t powersgd_rank = 0;
  int64_t powersgd_start_step = 0;
  std::string offload;
  double offload_chunk_mb = 0;
  int64_t timeout_s = 0;
  std::string job_id;
};

struct LoraSection {
  bool enabled = false;
  int64_t rank = 0;
  double alpha = 0;
  double dropout = 0;
  std::string target_modules;
};

struct CheckpointSection {
  int64_t every_steps = 0;
  int64_t keep_last = 0;
  bool keep_best = false;
  bool async = false;
};

struct EvalSection {
  int64_t every_steps = 0;
  int64_t batch_size = 0;
  int64_t max_batches = 0;
};

struct LogSection {
  int64_t every_steps = 0;
  bool tensorboard = false;
  std::string level;
};

struct ObservabilitySection {
  int64_t prometheus_port = 0;
  std::string bind;
  double peak_tflops = 0;
};

struct ExpectSection {
  std::string metric;
  double target = 0;
  double tolerance = 0;
  int64_t budget_steps = 0;
  double budget_s = 0;
  std::string hardware;
  std::string reference;
};

struct Recipe {
  RunSection run;
  ModelSection model;
  DataSection data;
  TrainSection train;
  OptimSection optim;
  ScheduleSection schedule;
  PrecisionSection precision;
  ParallelSection parallel;
  LoraSection lora;
  CheckpointSection checkpoint;
  EvalSection eval;
  LogSection log;
  ObservabilitySection observability;
  ExpectSection expect;
};

}  // namespace dtrain
