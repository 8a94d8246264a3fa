#pragma once
// The recipe the language-model layout tests write (tests/session/test_pipeline.cpp,
// tests/train/test_llama_layouts.cpp): byte tokens (token_fixture.h), AdamW at 3e-3 with a
// cosine schedule, batch 2 per data rank, clipping at 1, a log line every step, and the
// [parallel] table last so that a test appends its layout (and any table after it).
#include <filesystem>
#include <fstream>
#include <string>

#include "token_fixture.h"

struct LmRecipe {
  std::string model;         // the [model] table
  int accum = 1;             // train.grad_accum
  int steps = 6;             // train.max_steps
  int ckpt_every = 6;        // checkpoint.every_steps
  int keep_last = 2;         // checkpoint.keep_last
  int eval_every = 6;        // eval.every_steps (2 batches of 2)
  std::string parallel;      // lines under [parallel] (after timeout_s = 30), then other tables
};

// Writes WORK/NAME.toml (runs in WORK/runs/NAME, removed first) and returns its path.
inline std::string write_lm_recipe(const std::string& work, const std::string& name, const LmRecipe& r) {
  namespace stdfs = std::filesystem;
  stdfs::create_directories(work);
  stdfs::remove_all(work + "/runs/" + name);
  const std::string path = work + "/" + name + ".toml";
  std::ofstream f(path);
  f << "[run]\nname = \"" << name << "\"\nout_dir = \"" << work << "/runs\"\nseed = 11\ndevice = \"cpu\"\nthreads = 1\n"
    << r.model << "[data]\nkind = \"tokens\"\npath = \"" << byte_tokens(work) << "\"\neval_split = \"val\"\n"
    << "[optim]\nname = \"adamw\"\nlr = 3e-3\nweight_decay = 0.01\n"
    << "[schedule]\nkind = \"cosine\"\nwarmup_steps = 2\n"
    << "[train]\nbatch_size = 2\ngrad_accum = " << r.accum << "\nmax_steps = " << r.steps << "\nclip_grad_norm = 1.0\n"
    << "[checkpoint]\nevery_steps = " << r.ckpt_every << "\nkeep_last = " << r.keep_last << "\n"
    << "[eval]\nevery_steps = " << r.eval_every << "\nbatch_size = 2\nmax_batches = 2\n"
    << "[log]\nevery_steps = 1\ntensorboard = false\n"
    << "[parallel]\ntimeout_s = 30\n" << r.parallel;
  return path;
}
