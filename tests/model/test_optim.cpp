// Optimizers, gradient clipping and LR schedules against torch.optim (run live through
// the project's venv python).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include <unistd.h>

#include "backend/backend.h"
#include "nn/params.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"

using namespace dtrain;

namespace {

// Runs a python script with the project's venv; returns stdout; fails the test on error.
std::string run_python(const std::string& name, const std::string& script) {
  const std::string dir = DTRAIN_BUILD_DIR;
  const std::string py = dir + "/" + name + ".py", err = dir + "/" + name + ".stderr";
  {
    std::ofstream f(py);
    f << script;
  }
  const std::string cmd = std::string(DTRAIN_SOURCE_DIR) + "/.venv/bin/python " + py + " 2>" + err;
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int rc = pclose(p);
  if (rc != 0) {
    std::ifstream e(err);
    std::stringstream ss;
    ss << e.rdbuf();
    FAIL("python reference failed (rc " << rc << "): " << ss.str());
  }
  std::remove(py.c_str());
  std::remove(err.c_str());
  return out;
}

// "key v0 v1 v2 ..." lines -> map
std::map<std::string, std::vector<double>> parse_lines(const std::string& out) {
  std::map<std::string, std::vector<double>> m;
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string key;
    if (!(ls >> key)) continue;
    double v;
    while (ls >> v) m[key].push_back(v);
  }
  return m;
}

// Three parameters: w [3,4] (decay), b [4] (no decay), w2 [2,2] (decay).
struct Toy {
  std::unique_ptr<Backend> be = make_backend("cpu");
  ParamStore ps;
  Toy() {
    ps.declare({"w", Shape{3, 4}, Init::Zeros, 0, true});
    ps.declare({"b", Shape{4}, Init::Zeros, 0, false});
    ps.declare({"w2", Shape{2, 2}, Init::Zeros, 0, true});
    ps.finalize(*be);
    std::vector<float> p(20);
    for (int i = 0; i < 20; ++i) p[size_t(i)] = float(0.5 * std::sin(1.1 * i + 0.3));
    be->copy_from_host(ps.flat_params().data, p.data(), 80);
  }
  // grads of step s, multiplied by `mult` (the optimizer is given grad_scale = 1/mult)
  void set_grads(int s, float mult) {
    std::vector<float> g(20);
    for (int i = 0; i < 20; ++i) g[size_t(i)] = float(std::cos(0.7 * i + 1.3 * s) + 0.005 * i) * mult;
    be->copy_from_host(ps.flat_grads().data, g.data(), 80);
  }
  std::vector<float> params() {
    std::vector<float> p(20);
    be->copy_to_host(p.data(), ps.flat_params().data, 80);
    return p;
  }
};

float step_lr(int s) { return float(0.1 * (1.0 - 0.1 * s)); }

const char* kOptimScript = R"PY(
import math, torch
def init():
    p = torch.tensor([0.5 * math.sin(1.1 * i + 0.3) for i in range(20)], dtype=torch.float32)
    w = p[:12].clone().view(3, 4).requires_grad_(); b = p[12:16].clone().requires_grad_()
    w2 = p[16:].clone().view(2, 2).requires_grad_()
    return w, b, w2
def grads(s):
    return torch.tensor([math.cos(0.7 * i + 1.3 * s) + 0.005 * i for i in range(20)], dtype=torch.float32)
def run(name, make, wd, decay_all):
    w, b, w2 = init()
    groups = [{'params': [w, b, w2], 'weight_decay': wd}] if decay_all else \
             [{'params': [w, w2], 'weight_decay': wd}, {'params': [b], 'weight_decay': 0.0}]
    opt = make(groups)
    for s in range(5):
        g = grads(s)
        w.grad = g[:12].view(3, 4).clone(); b.grad = g[12:16].clone(); w2.grad = g[16:].view(2, 2).clone()
        for grp in opt.param_groups: grp['lr'] = float(torch.tensor(0.1 * (1.0 - 0.1 * s), dtype=torch.float32))
        opt.step()
    vals = torch.cat([w.detach().flatten(), b.detach(), w2.detach().flatten()])
    print(name, ' '.join(repr(float(v)) for v in vals))
SGD = torch.optim.SGD; AdamW = torch.optim.AdamW
run('sgd_a', lambda g: SGD(g, lr=0.1, momentum=0.9), 0.01, False)
run('sgd_b', lambda g: SGD(g, lr=0.1, momentum=0.9, nesterov=True), 0.05, False)
run('sgd_c', lambda g: SGD(g, lr=0.1, momentum=0.8, dampening=0.3), 0.0, False)
run('sgd_d', lambda g: SGD(g, lr=0.1, momentum=0.0), 0.1, False)
run('sgd_e', lambda g: SGD(g, lr=0.1, momentum=0.9), 0.01, True)
run('adamw_f', lambda g: AdamW(g, lr=0.1, betas=(0.9, 0.999), eps=1e-8), 0.01, False)
run('adamw_g', lambda g: AdamW(g, lr=0.1, betas=(0.8, 0.99), eps=1e-6), 0.1, True)

def sched(name, total, make):
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=BASE[name])
    s = make(opt)
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]['lr'])
        opt.step(); s.step()
    print(name, ' '.join(repr(v) for v in lrs))
L = torch.optim.lr_scheduler
BASE = {'cos_warm': 0.1, 'step': 0.1, 'multi_warm': 0.2, 'const_warm': 0.05, 'cos': 0.3, 'lin_warm': 0.1, 'lin': 0.2}
sched('cos_warm', 20, lambda o: L.SequentialLR(o, [L.LinearLR(o, 0.1, 1.0, total_iters=5),
      L.CosineAnnealingLR(o, T_max=15, eta_min=0.001)], milestones=[5]))
sched('step', 30, lambda o: L.StepLR(o, step_size=7, gamma=0.5))
sched('multi_warm', 15, lambda o: L.SequentialLR(o, [L.LinearLR(o, 0.25, 1.0, total_iters=3),
      L.MultiStepLR(o, milestones=[4, 9], gamma=0.1)], milestones=[3]))
sched('const_warm', 10, lambda o: L.SequentialLR(o, [L.LinearLR(o, 0.5, 1.0, total_iters=4),
      L.ConstantLR(o, factor=1.0, total_iters=0)], milestones=[4]))
sched('cos', 10, lambda o: L.CosineAnnealingLR(o, T_max=10))
sched('lin_warm', 20, lambda o: L.SequentialLR(o, [L.LinearLR(o, 0.1, 1.0, total_iters=5),
      L.LinearLR(o, 1.0, 0.001 / 0.1, total_iters=15)], milestones=[5]))
sched('lin', 12, lambda o: L.LinearLR(o, 1.0, 0.0, total_iters=12))
)PY";

const std::map<std::string, std::vector<double>>& reference() {
  static std::map<std::string, std::vector<double>> ref = parse_lines(run_python("test_optim_ref" + std::to_string(::getpid()), kOptimScript));
  return ref;
}

void check_close(const std::vector<float>& got, const std::vector<double>& want, double tol,
                 const std::string& what) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO(what << " [" << i << "]: got " << got[i] << " want " << want[i]);
    CHECK(std::fabs(got[i] - want[i]) <= tol * (1.0 + std::fabs(want[i])));
  }
}

template <typename Opt, typename Cfg>
std::vector<float> run_steps(const Cfg& c) {
  Toy t;
  Opt opt(t.ps, c);
  for (int s = 0; s < 5; ++s) {
    t.set_grads(s, 4.f);
    opt.step(step_lr(s), 0.25f);  // exact power of two: same as unscaled grads
  }
  CHECK(opt.steps() == 5);
  return t.params();
}

}  // namespace

TEST_SUITE("unit") {
TEST_CASE("SGD trajectories equal torch.optim.SGD (momentum / nesterov / dampening / wd groups)") {
  const auto& ref = reference();
  SgdConfig a;
  a.momentum = 0.9f;
  a.weight_decay = 0.01f;
  check_close(run_steps<Sgd>(a), ref.at("sgd_a"), 1e-6, "sgd_a");
  SgdConfig b;
  b.momentum = 0.9f;
  b.nesterov = true;
  b.weight_decay = 0.05f;
  check_close(run_steps<Sgd>(b), ref.at("sgd_b"), 1e-6, "sgd_b");
  SgdConfig c;
  c.momentum = 0.8f;
  c.dampening = 0.3f;
  check_close(run_steps<Sgd>(c), ref.at("sgd_c"), 1e-6, "sgd_c");
  SgdConfig d;
  d.momentum = 0.f;
  d.weight_decay = 0.1f;
  check_close(run_steps<Sgd>(d), ref.at("sgd_d"), 1e-6, "sgd_d");
  SgdConfig e = a;
  e.decay_bias_and_norm = true;
  check_close(run_steps<Sgd>(e), ref.at("sgd_e"), 1e-6, "sgd_e");
}

TEST_CASE("AdamW trajectories equal torch.optim.AdamW") {
  const auto& ref = reference();
  AdamWConfig f;
  f.weight_decay = 0.01f;
  check_close(run_steps<AdamW>(f), ref.at("adamw_f"), 2e-6, "adamw_f");
  AdamWConfig g;
  g.beta1 = 0.8f;
  g.beta2 = 0.99f;
  g.eps = 1e-6f;
  g.weight_decay = 0.1f;
  g.decay_bias_and_norm = true;
  check_close(run_steps<AdamW>(g), ref.at("adamw_g"), 2e-6, "adamw_g");
}

TEST_CASE("optimizer state export/import resumes bit-identically") {
  for (int kind = 0; kind < 2; ++kind) {
    SgdConfig sc;
    sc.momentum = 0.9f;
    sc.weight_decay = 0.01f;
    AdamWConfig ac;
    auto make = [&](ParamStore& ps) -> std::unique_ptr<Optimizer> {
      if (kind == 0) return std::make_unique<Sgd>(ps, sc);
      return std::make_unique<AdamW>(ps, ac);
    };
    Toy full;
    auto o1 = make(full.ps);
    for (int s = 0; s < 5; ++s) { full.set_grads(s, 1.f); o1->step(step_lr(s), 1.f); }

    Toy first;
    auto o2 = make(first.ps);
    for (int s = 0; s < 3; ++s) { first.set_grads(s, 1.f); o2->step(step_lr(s), 1.f); }
    auto exported = o2->export_state();
    CHECK(exported.size() == (kind == 0 ? 2u : 3u));
    CHECK(exported.back().name == "step");
    std::map<std::string, ParamStore::Exported> byname;
    for (auto& x : exported) byname[x.name] = x;
    auto lookup = [&](const std::string& n) -> std::optional<ImportTensor> {
      auto it = byname.find(n);
      if (it == byname.end()) return std::nullopt;
      return ImportTensor{it->second.dtype, it->second.shape, it->second.bytes.data(), it->second.bytes.size()};
    };
    Toy second;  // fresh params: copy the trained ones over
    second.be->copy_from_host(second.ps.flat_params().data, first.params().data(), 80);
    auto o3 = make(second.ps);
    o3->import_state(lookup, "optim.safetensors");
    CHECK(o3->steps() == 3);
    for (int s = 3; s < 5; ++s) { second.set_grads(s, 1.f); o3->step(step_lr(s), 1.f); }
    CHECK(second.params() == full.params());

    // a wrong shape is a UserError naming the tensor
    byname[kind == 0 ? "momentum" : "exp_avg"].shape = {19};
    Toy third;
    auto o4 = make(third.ps);
    CHECK_THROWS_WITH_AS(o4->import_state(lookup, "optim.safetensors"),
                         doctest::Contains(kind == 0 ? "'momentum': expected F32 [20]" : "'exp_avg': expected F32 [20]"),
                         UserError);
  }
}

TEST_CASE("a sharded optimizer updates only its range / with segments clipped to it") {
  SgdConfig c;
  c.momentum = 0.9f;
  c.weight_decay = 0.1f;
  Toy full, shard;
  Sgd o_full(full.ps, c);
  Sgd o_a(shard.ps, c, FlatRange{0, 14});   // crosses the w|b segment boundary
  Sgd o_b(shard.ps, c, FlatRange{14, -1});  // b tail + w2
  for (int s = 0; s < 3; ++s) {
    full.set_grads(s, 1.f);
    shard.set_grads(s, 1.f);
    o_full.step(step_lr(s), 1.f);
    o_a.step(step_lr(s), 1.f);
    o_b.step(step_lr(s), 1.f);
  }
  CHECK(shard.params() == full.params());
  CHECK(o_a.export_state()[0].shape == std::vector<int64_t>{14});
  CHECK(o_b.export_state()[0].shape == std::vector<int64_t>{6});
}

TEST_CASE("gradient clipping coefficient follows clip_grad_norm_") {
  auto be = make_backend("cpu");
  ParamStore ps;
  ps.declare({"g", Shape{4}, Init::Zeros, 0, true});
  ps.finalize(*be);
  const float g[4] = {3.f, 0.f, -4.f, 0.f};  // norm 5
  be->copy_from_host(ps.flat_grads().data, g, 16);
  float norm = 0;
  CHECK(clip_coef(*be, ps.flat_grads(), 1.f, &norm) == doctest::Approx(1.0 / (5.0 + 1e-6)));
  CHECK(norm == doctest::Approx(5.0));
  CHECK(clip_coef(*be, ps.flat_grads(), 10.f, &norm) == 1.f);  // clamped to 1
  CHECK(clip_coef(*be, ps.flat_grads(), 1.f, &norm, 0.5f) == doctest::Approx(1.0 / (2.5 + 1e-6)));
  CHECK(norm == doctest::Approx(2.5));
  CHECK(clip_coef(*be, ps.flat_grads(), 0.f, &norm) == 1.f);  // disabled
  CHECK(std::isnan(clip_coef_from_norm(NAN, 1.f)));
}

TEST_CASE("LR schedules equal torch.optim.lr_scheduler (SequentialLR with LinearLR warmup)") {
  const auto& ref = reference();
  auto check = [&](const std::string& name, const LrSchedule& s) {
    const auto& want = ref.at(name);
    for (size_t i = 0; i < want.size(); ++i) {
      INFO(name << " step " << i << ": got " << s.lr(int64_t(i)) << " want " << want[i]);
      CHECK(s.lr(int64_t(i)) == doctest::Approx(want[i]).epsilon(1e-9));
    }
  };
  check("cos_warm", LrSchedule(LrKind::Cosine, 0.1, 20, 5, 0.1, 1, 0.1, {}, 0.001));
  check("step", LrSchedule(LrKind::Step, 0.1, 30, 0, 0.0, 7, 0.5));
  check("multi_warm", LrSchedule(LrKind::MultiStep, 0.2, 15, 3, 0.25, 1, 0.1, {4, 9}));
  check("const_warm", LrSchedule(LrKind::Constant, 0.05, 10, 4, 0.5));
  check("cos", LrSchedule(LrKind::Cosine, 0.3, 10));
  check("lin_warm", LrSchedule(LrKind::Linear, 0.1, 20, 5, 0.1, 1, 0.1, {}, 0.001));
  check("lin", LrSchedule(LrKind::Linear, 0.2, 12));
  CHECK(LrSchedule(LrKind::Linear, 0.1, 20, 5, 0.1, 1, 0.1, {}, 0.001).lr(30) == doctest::Approx(0.001));
  // past the end the cosine stays at min_lr
  CHECK(LrSchedule(LrKind::Cosine, 0.1, 20, 5, 0.1, 1, 0.1, {}, 0.001).lr(25) == doctest::Approx(0.001));
}

TEST_CASE("schedule and optimizer config errors are one-line UserErrors") {
  CHECK_THROWS_WITH_AS(parse_lr_kind("onecycle", "schedule.kind"),
                       "schedule.kind: expected one of constant, step, multistep, cosine, linear, got 'onecycle'",
                       UserError);
  CHECK_THROWS_WITH_AS(LrSchedule(LrKind::Linear, 0.1, 10, 0, 0, 1, 0.1, {}, 0.5),
                       "schedule.min_lr: expected a value in [0, optim.lr = 0.1], got 0.5", UserError);
  CHECK_THROWS_AS(LrSchedule(LrKind::Cosine, 0.1, 10, 10), UserError);
  CHECK_THROWS_AS(LrSchedule(LrKind::MultiStep, 0.1, 10, 0, 0, 1, 0.1, {5, 3}), UserError);
  Toy t;
  SgdConfig bad;
  bad.momentum = 0.f;
  bad.nesterov = true;
  CHECK_THROWS_AS(Sgd(t.ps, bad), UserError);
}
}
