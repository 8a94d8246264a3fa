#pragma once
// Entry points of the dtrain subcommands. src/main.cpp parses the command line with
// CLI11 into these structs and calls the functions; it holds no logic. Each function
// returns the process exit code and may throw dtrain::Error (main maps it: 2 user
// error, 1 runtime fault). Implementations live next to the code they drive:
//   train/eval/bench/inspect -> src/train/, data -> src/data/, info/version -> src/cli/.
#include <optional>
#include <string>
#include <vector>

namespace dtrain {

struct TrainArgs {
  std::string config;                   // recipe path ("" when resuming from a run dir)
  std::vector<std::string> overrides;   // --set section.key=value (repeatable)
  bool resume = false;                  // --resume given
  std::string resume_dir;               // --resume RUN_DIR ("" = the recipe's run dir)
  std::string device;                   // --device cpu|cuda|auto ("" = recipe's run.device)
  // launcher (distributed issue)
  int nproc_per_node = 1, nnodes = 1, node_rank = 0, max_restarts = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
};
int cmd_train(const TrainArgs& a);

struct EvalArgs {
  std::string config;
  std::vector<std::string> overrides;
  std::string checkpoint;  // checkpoint directory (or a run dir: its latest)
  std::string device;
};
int cmd_eval(const EvalArgs& a);

// dtrain sample: text from a GPT checkpoint (its recipe and tokenizer come from the run).
struct SampleArgs {
  std::string checkpoint;  // checkpoint directory (or a run dir: its latest)
  std::string prompt = "\n";
  int tokens = 100;
  double temperature = 1.0;
  int top_k = 0;
  uint64_t seed = 0;
  std::string vocab;  // GPT-2 tokenizer: directory with encoder.json and vocab.bpe
  std::string device;
  bool no_kv_cache = false;  // --no-kv-cache: one full forward per token (reference path)
};
int cmd_sample(const SampleArgs& a);

// dtrain import gpt2: a Hugging Face GPT-2 model.safetensors -> run directory `out` holding
// a step-0 checkpoint (src/train/import_cmd.cpp).
struct ImportGpt2Args {
  std::string file, out;
  std::string config;  // --config RECIPE: its [model] must fit the file ("" = inferred)
};
int cmd_import_gpt2(const ImportGpt2Args& a);

struct BenchArgs {
  std::string config;
  std::vector<std::string> overrides;
  std::string device;
  int warmup = 5, steps = 20;
  std::string json;  // also write the results as one JSON object to this file
};
int cmd_bench(const BenchArgs& a);

struct InspectArgs {
  std::string path;  // checkpoint dir or run dir
};
int cmd_inspect(const InspectArgs& a);

struct DataFashionMnistArgs {
  std::string src = "/usr/share/datasets/fashion-mnist";  // directory with the IDX .gz files
  std::string out = "data/fashion-mnist";
  int shard_size = 10000;  // samples per tar shard
};
int cmd_data_fashion_mnist(const DataFashionMnistArgs& a);

struct DataImagesArgs {
  std::string src;  // ImageFolder tree: SRC/<class>/<image>
  std::string out;
  std::string split = "train";
  int shard_size = 10000;
};
int cmd_data_images(const DataImagesArgs& a);

int cmd_info();
int cmd_version();

}  // namespace dtrain
