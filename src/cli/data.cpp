// dtrain data: dataset converters into dtrain's shard formats (src/data/): Fashion-MNIST and
// ImageFolder trees to WebDataset tar shards, text to llm.c token shards, chat / prompt-completion
// JSONL to SFT shards (token shards + loss mask and documents), the synthetic
// shapes set, image/mask folders, and manifests for shards written by other tools.
#include <fmt/format.h>

#include "cli/command.h"
#include "core/log.h"
#include "data/convert.h"
#include "data/index.h"
#include "data/qa_pairs.h"
#include "data/sft.h"
#include "data/shapes.h"
#include "data/token_shards.h"

namespace dtrain::cli {

namespace {

void cmd_fashion_mnist(const data::FashionMnistSpec& a) {
  const data::ConvertResult r = data::convert_fashion_mnist(a);
  std::string counts;
  for (auto& [s, n] : r.splits) counts += fmt::format("{}{} {}", counts.empty() ? "" : ", ", n, s);
  if (r.already_prepared)
    log::console(fmt::format("{}: already prepared ({}; checksums verified), nothing to do", a.out, counts));
  else
    log::console(fmt::format("{}: wrote Fashion-MNIST ({}) in {:.1f} s", a.out, counts, r.seconds));
}

void cmd_images(const data::ImageFolderSpec& a) {
  const data::ConvertResult r = data::convert_image_folder(a);
  const int64_t n = r.splits.empty() ? 0 : r.splits[0].second;
  if (r.already_prepared)
    log::console(fmt::format("{}: split '{}' already prepared ({} samples, identical), nothing to do", a.out, a.split, n));
  else
    log::console(fmt::format("{}: wrote split '{}' ({} samples) in {:.1f} s", a.out, a.split, n, r.seconds));
}

// A subcommand `name` of `data` with its spec; once parsed, `run` calls f(spec).
template <typename Spec, typename F>
std::pair<std::shared_ptr<Spec>, CLI::App*> subcommand(CLI::App* data, Run& run, const char* name, const char* help,
                                                       F f) {
  auto spec = std::make_shared<Spec>();
  CLI::App* c = data->add_subcommand(name, help);
  c->callback([spec, f, &run] {
    run = [spec, f] {
      f(*spec);
      return 0;
    };
  });
  return {spec, c};
}

// --out and --shard-size of the image converters.
template <typename Spec>
void add_out_and_shard_size(CLI::App* c, Spec& s, bool out_required) {
  CLI::Option* out = c->add_option("--out", s.out, "output directory")->type_name("DIR");
  if (out_required) out->required();
  else out->capture_default_str();
  c->add_option("--shard-size", s.shard_size, "samples per shard")->capture_default_str()->check(CLI::Range(1, 100000000));
}

}  // namespace

void add_data(CLI::App& app, Run& run) {
  auto* data = app.add_subcommand("data", "convert datasets into dtrain's shard formats");
  data->require_subcommand(1);
  set_examples(data, {"dtrain data fashion-mnist", "dtrain data images PHOTOS/train --out data/imagefolder --split train",
                      "dtrain data tokenize /usr/share/games/fortunes/fortunes --out data/fortunes --tokenizer byte",
                      "dtrain data sft chats.jsonl --tokenizer MODEL_DIR/tokenizer.json --template chatml --out data/chats",
                      "dtrain data shapes --out data/shapes --count 2000 --size 64 --classes 4",
                      "dtrain data index SHARDS_DIR", "dtrain data SUBCOMMAND --help"});

  auto [fa, fm] = subcommand<data::FashionMnistSpec>(data, run, "fashion-mnist",
                                                     "Fashion-MNIST IDX files -> WebDataset tar shards", cmd_fashion_mnist);
  fm->add_option("--src", fa->src, "directory with the IDX .gz files")->capture_default_str()->type_name("DIR");
  add_out_and_shard_size(fm, *fa, false);
  fm->add_option("--holdout", fa->holdout,
                 "hold out the last N training images as split \"val\" (choices tuned without the test set)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t(0), int64_t(59999)))
      ->type_name("N");
  set_examples(fm, {"dtrain data fashion-mnist                      (Debian's dataset-fashion-mnist -> data/fashion-mnist)",
                    "dtrain data fashion-mnist --out /tmp/fm --shard-size 5000",
                    "dtrain data fashion-mnist --out data/fashion-mnist-holdout --holdout 5000   (train 55000, val 5000)"});

  auto [da, im] = subcommand<data::ImageFolderSpec>(
      data, run, "images", "ImageFolder tree (SRC/<class>/<image>) -> WebDataset tar shards", cmd_images);
  im->add_option("src", da->src, "ImageFolder root")->type_name("SRC")->required();
  add_out_and_shard_size(im, *da, true);
  im->add_option("--split", da->split, "split name of the shards")->capture_default_str();
  set_examples(im, {"dtrain data images PHOTOS/train --out data/imagefolder --split train",
                    "dtrain data images PHOTOS/val --out data/imagefolder --split val"});

  auto [tk, tok] = subcommand<data::TokenizeSpec>(data, run, "tokenize",
                                                  "text files -> llm.c token shards (train_000000.bin, val_000000.bin; "
                                                  "uint32 tokens beyond 65536 ids)",
                                                  data::tokenize_files);
  tok->add_option("inputs", tk->inputs, "text files (each one document), or directories of them (their text files in name order; binary files and symlinks to files already taken are skipped)")->type_name("INPUT...")->required();
  tok->add_option("--out", tk->out, "output directory")->type_name("DIR")->required();
  tok->add_option("--tokenizer", tk->tokenizer,
                  "byte | gpt2 | a Hugging Face byte-level BPE tokenizer.json (the file or a directory holding it; "
                  "copied beside the shards). Documents are encoded without special tokens, then marked: the "
                  "tokenizer.json's post-processor template around each (Llama 3: <|begin_of_text|> first), else "
                  "<|endoftext|> before each")
      ->capture_default_str()
      ->type_name("byte|gpt2|FILE");
  tok->add_option("--vocab", tk->vocab, "with --tokenizer gpt2: directory with GPT-2's encoder.json and vocab.bpe, or "
                                        "vocab.json and merges.txt (copied beside the shards)")
      ->type_name("DIR");
  tok->add_option("--val-fraction", tk->val_fraction, "share of tokens for the validation shard")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 0.9));
  tok->add_option("--shard-tokens", tk->shard_tokens, "tokens per train shard (llm.c's fineweb: 10^8)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t(1024), int64_t(2147483647)));
  tok->add_option("--workers", tk->workers, "encoding threads (0 = every core)")->capture_default_str()->check(CLI::Range(0, 1024));
  set_examples(tok, {"dtrain data tokenize /usr/share/games/fortunes --out data/fortunes --tokenizer byte",
                     "dtrain data tokenize corpus/*.txt --out data/corpus --tokenizer gpt2 --vocab GPT2_FILES_DIR",
                     "dtrain data tokenize corpus/*.txt --out data/corpus --tokenizer MODEL_DIR/tokenizer.json"});

  auto [sf, sfc] = subcommand<data::SftSpec>(
      data, run, "sft",
      "chat / prompt-completion JSONL -> SFT shards: llm.c token shards (<split>_000000.bin) with a .sft side file "
      "each (documents, loss mask); docs/finetune.md",
      data::sft_convert);
  sfc->add_option("inputs", sf->inputs,
                  "JSONL files, a row a line: {\"prompt\": ..., \"completion\": ...} or {\"messages\": [{\"role\": "
                  "\"system\"|\"user\"|\"assistant\", \"content\": ...}, ...]}; one row = one document")
      ->type_name("FILE.jsonl...")
      ->required();
  sfc->add_option("--tokenizer", sf->tokenizer,
                  "byte | gpt2 | a Hugging Face byte-level BPE tokenizer.json (the file or a directory holding it); the "
                  "template's special tokens must be among its added tokens")
      ->capture_default_str()
      ->type_name("byte|gpt2|FILE");
  sfc->add_option("--vocab", sf->vocab, "with --tokenizer gpt2: directory with GPT-2's vocabulary files")->type_name("DIR");
  sfc->add_option("--template", sf->template_name,
                  "chat template: chatml (Qwen2's), llama3 (Llama 3 instruct's) or plain (### Prompt: / ### Response:)")
      ->required()
      ->check(CLI::IsMember(sft::ChatTemplate::names()))
      ->type_name("NAME");
  sfc->add_option("--out", sf->out, "output directory")->type_name("DIR")->required();
  sfc->add_option("--split", sf->split,
                  "split name: the shards are <split>_000000.bin + .sft (run again with --split val on held-out rows)")
      ->capture_default_str();
  sfc->add_flag("--skip-bad", sf->skip_bad,
                "skip bad rows (counted, reported in one line) instead of exiting 2 on the first, naming its line");
  sfc->add_option("--shard-tokens", sf->shard_tokens, "tokens per shard at most (a document never crosses shards)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t(1024), int64_t(2147483647)));
  set_examples(sfc, {"dtrain data sft chats.jsonl --tokenizer MODEL_DIR/tokenizer.json --template chatml --out data/chats",
                     "dtrain data sft held_out.jsonl --tokenizer MODEL_DIR --template chatml --out data/chats --split val",
                     "dtrain data sft qa.jsonl --tokenizer gpt2 --vocab GPT2_FILES_DIR --template plain --out data/qa --skip-bad"});

  auto [qa, qac] = subcommand<data::QaSpec>(
      data, run, "qa",
      "fortune files -> question/answer JSONL for `data sft`: each entry with a \"Q:\" and an \"A:\" line is "
      "{\"prompt\": Q, \"completion\": A} in DIR/train.jsonl, every N-th in DIR/val.jsonl",
      data::write_qa_pairs);
  qac->add_option("inputs", qa->inputs, "fortune files (entries separated by lines holding \"%\"), UTF-8")
      ->type_name("FILE...")
      ->required();
  qac->add_option("--out", qa->out, "output directory")->type_name("DIR")->required();
  qac->add_option("--val-every", qa->val_every, "every N-th pair is held out (0: none)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t(0), int64_t(1000000)));
  qac->add_option("--template", qa->template_name,
                  "then run `data sft` with this template on both files into DIR (splits train and val)")
      ->check(CLI::IsMember(sft::ChatTemplate::names()))
      ->type_name("NAME");
  qac->add_option("--tokenizer", qa->tokenizer, "with --template: the tokenizer, as data sft takes it")
      ->capture_default_str()
      ->type_name("byte|gpt2|FILE");
  qac->add_option("--vocab", qa->vocab, "with --template and --tokenizer gpt2: GPT-2's vocabulary files")->type_name("DIR");
  set_examples(qac, {"dtrain data qa /usr/share/games/fortunes/riddles.u8 /usr/share/games/fortunes/law.u8 --out data/qa",
                     "dtrain data qa /usr/share/games/fortunes/riddles.u8 --out data/qa --template plain --tokenizer byte"});

  auto [sh, shp] = subcommand<data::ShapesSpec>(
      data, run, "shapes", "synthetic segmentation set (circles, rectangles, triangles) -> shards", data::write_shapes_dataset);
  shp->add_option("--out", sh->out, "output directory")->type_name("DIR")->required();
  shp->add_option("--count", sh->count, "images in all")->capture_default_str()->check(CLI::Range(2, 10000000));
  shp->add_option("--size", sh->size, "image side in pixels")->capture_default_str()->check(CLI::Range(8, 4096));
  shp->add_option("--classes", sh->classes, "classes including background")->capture_default_str()->check(CLI::Range(2, 64));
  shp->add_option("--seed", sh->seed, "generator seed")->capture_default_str();
  shp->add_option("--val-fraction", sh->val_fraction, "share of images in the val split")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 0.9));
  set_examples(shp, {"dtrain data shapes --out data/shapes --count 2000 --size 64 --classes 4"});

  auto [sg, seg] = subcommand<data::SegmentationSpec>(
      data, run, "segmentation", "IMAGES/ + MASKS/ folders (matching stems) -> shards", data::convert_segmentation);
  seg->add_option("images", sg->images, "folder of images")->type_name("IMAGES")->required();
  seg->add_option("masks", sg->masks, "folder of masks (8-bit, value = class)")->type_name("MASKS")->required();
  seg->add_option("--out", sg->out, "output directory")->type_name("DIR")->required();
  seg->add_option("--split", sg->split, "split name")->capture_default_str();
  set_examples(seg, {"dtrain data segmentation train/images train/masks --out data/seg --split train"});

  auto [dx, idx] = subcommand<data::IndexSpec>(
      data, run, "index", "write manifest.json for WebDataset shards made by another tool", data::index_dataset);
  idx->add_option("dir", dx->dir, "dataset directory (splits: DIR/<split>/*.tar, or --split)")->type_name("DIR")->required();
  idx->add_option("--split", dx->splits,
                  "a split and its shards: NAME=GLOB relative to DIR, e.g. train='train-*.tar' (repeatable)")
      ->type_name("NAME=GLOB");
  idx->add_option("--num-classes", dx->num_classes, "number of classes (default: largest label or mask value + 1)")
      ->check(CLI::Range(2, 1000000));
  idx->add_flag("--force", dx->force, "replace an existing manifest.json");
  set_examples(idx, {"dtrain data index SHARDS_DIR                   (SHARDS_DIR/train/*.tar, SHARDS_DIR/val/*.tar)",
                     "dtrain data index DIR --split train='train-*.tar' --split val='val-*.tar'"});
}

}  // namespace dtrain::cli
