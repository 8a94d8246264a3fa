// ResNet family: parameter counts and state_dict names/shapes against torchvision,
// logits/loss/every gradient/running stats against PyTorch on tiny models, finite
// differences through whole residual networks, and overfitting a fixed batch.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <unistd.h>

#include "core/rng.h"
#include "models/resnet.h"
#include "nn/loss.h"
#include "optim/optimizer.h"

using namespace dtrain;

namespace {

// The reference: torchvision's blocks assembled into the same topology as build_resnet
// (stem width w, stage widths w, 2w, 4w(, 8w)), random BN affine params, one training
// forward/backward with label-smoothed cross-entropy. Every tensor goes to <case>.bin
// with a text manifest "<name> <dtype> <offset> <nbytes> <ndim> <dims...>".
const char* kRefScript = R"PY(
import sys, numpy as np, torch, torch.nn as nn, torchvision
from torchvision.models.resnet import BasicBlock, Bottleneck
out = sys.argv[1]
torch.manual_seed(0)

with open(out + '/names.txt', 'w') as f:
    for arch in ('resnet18', 'resnet50'):
        sd = getattr(torchvision.models, arch)().state_dict()
        for k, v in sd.items():
            dt = {torch.float32: 'F32', torch.int64: 'I64'}[v.dtype]
            f.write(' '.join([arch, k, dt] + [str(d) for d in v.shape]) + '\n')

class Net(nn.Module):
    def __init__(s, block, layers, w, stem, classes, inch):
        super().__init__()
        big = stem == 'imagenet'
        s.conv1 = nn.Conv2d(inch, w, 7 if big else 3, 2 if big else 1, 3 if big else 1, bias=False)
        s.bn1 = nn.BatchNorm2d(w)
        s.relu = nn.ReLU(inplace=True)
        s.maxpool = nn.MaxPool2d(3, 2, 1) if big else nn.Identity()
        s.inplanes = w
        for i, n in enumerate(layers):
            setattr(s, 'layer%d' % (i + 1), s.make(block, w << i, n, 1 if i == 0 else 2))
        s.avgpool = nn.AdaptiveAvgPool2d(1)
        s.fc = nn.Linear(s.inplanes, classes)
        s.nstages = len(layers)
        for m in s.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode='fan_out', nonlinearity='relu')
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.uniform_(m.weight, 0.5, 1.5); nn.init.uniform_(m.bias, -0.3, 0.3)
    def make(s, block, planes, n, stride):
        e = block.expansion
        ds = None
        if stride != 1 or s.inplanes != planes * e:
            ds = nn.Sequential(nn.Conv2d(s.inplanes, planes * e, 1, stride, bias=False), nn.BatchNorm2d(planes * e))
        layers = [block(s.inplanes, planes, stride, ds)]
        s.inplanes = planes * e
        layers += [block(s.inplanes, planes) for _ in range(1, n)]
        return nn.Sequential(*layers)
    def forward(s, x):
        x = s.maxpool(s.relu(s.bn1(s.conv1(x))))
        for i in range(s.nstages):
            x = getattr(s, 'layer%d' % (i + 1))(x)
        return s.fc(torch.flatten(s.avgpool(x), 1))

def case(name, block, layers, w, stem, classes, n, hw):
    net = Net(block, layers, w, stem, classes, 3).double()  # float64: the exact answer
    net.train()
    items = []
    for k, v in net.state_dict().items():
        items.append(('state/' + k, v.clone()))
    x = torch.randn(n, 3, hw, hw).double()
    y = torch.randint(0, classes, (n,))
    logits = net(x)
    loss = nn.functional.cross_entropy(logits, y, label_smoothing=0.1)
    loss.backward()
    items += [('input', x.permute(0, 2, 3, 1).contiguous()), ('labels', y.to(torch.int32)),
              ('logits', logits.detach()), ('loss', loss.detach())]
    for k, p in net.named_parameters():
        items.append(('grad/' + k, p.grad))
    for k, v in net.state_dict().items():
        if 'running' in k or 'num_batches' in k:
            items.append(('after/' + k, v.clone()))
    off = 0
    with open(out + '/' + name + '.bin', 'wb') as fb, open(out + '/' + name + '.txt', 'w') as ft:
        for k, t in items:
            a = t.detach().numpy()
            if a.dtype == np.float64: a = a.astype(np.float32)
            dt = {np.dtype('float32'): 'F32', np.dtype('int64'): 'I64', np.dtype('int32'): 'I32'}[a.dtype]
            b = a.tobytes()
            fb.write(b)
            ft.write(' '.join([k, dt, str(off), str(len(b)), str(a.ndim)] + [str(d) for d in a.shape]) + '\n')
            off += len(b)

case('cifar8', BasicBlock, [1, 1, 1], 4, 'cifar', 5, 4, 8)
case('r50w4', Bottleneck, [3, 4, 6, 3], 4, 'imagenet', 7, 8, 64)
)PY";

struct RefTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
  const float* f32() const { return reinterpret_cast<const float*>(bytes.data()); }
  size_t count() const { return bytes.size() / (dtype == "I64" ? 8 : 4); }
};
using RefMap = std::map<std::string, RefTensor>;

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Runs the reference script once per build directory: outputs are reused while the
// script is unchanged (ctest runs every test case in its own process). Each generating
// process works in its own directory and renames it into place.
const std::string& ref_dir() {
  static std::string dir = [] {
    namespace fs = std::filesystem;
    const std::string base = std::string(DTRAIN_BUILD_DIR) + "/test_resnet_ref";
    if (fs::exists(base + "/done") && read_file(base + "/make_ref.py") == kRefScript) return base;
    const std::string tmp = base + ".tmp" + std::to_string(::getpid());
    fs::create_directories(tmp);
    {
      std::ofstream f(tmp + "/make_ref.py");
      f << kRefScript;
    }
    const std::string cmd = std::string(DTRAIN_SOURCE_DIR) + "/.venv/bin/python " + tmp +
                            "/make_ref.py " + tmp + " > " + tmp + "/log.txt 2>&1";
    const int rc = std::system(cmd.c_str());
    if (rc != 0) FAIL("PyTorch reference script failed: " << read_file(tmp + "/log.txt"));
    std::ofstream(tmp + "/done") << "ok\n";
    std::error_code ec;
    fs::remove_all(base, ec);
    fs::rename(tmp, base, ec);
    return ec ? tmp : base;  // another process won the race: use our own copy
  }();
  return dir;
}

RefMap load_ref(const std::string& name) {
  const std::string base = ref_dir() + "/" + name;
  std::ifstream bin(base + ".bin", std::ios::binary), txt(base + ".txt");
  REQUIRE(bin.good());
  REQUIRE(txt.good());
  RefMap m;
  std::string line;
  while (std::getline(txt, line)) {
    std::istringstream ls(line);
    std::string key;
    RefTensor t;
    size_t off, nbytes;
    int ndim;
    ls >> key >> t.dtype >> off >> nbytes >> ndim;
    t.shape.resize(size_t(ndim));
    for (auto& d : t.shape) ls >> d;
    t.bytes.resize(nbytes);
    bin.seekg(std::streamoff(off));
    bin.read(reinterpret_cast<char*>(t.bytes.data()), std::streamsize(nbytes));
    m[key] = std::move(t);
  }
  return m;
}

// max |a - b| / max |b|
double rel_err(const float* a, const float* b, size_t n) {
  double e = 0, m = 1e-12;
  for (size_t i = 0; i < n; ++i) {
    e = std::max(e, double(std::fabs(a[i] - b[i])));
    m = std::max(m, double(std::fabs(b[i])));
  }
  return e / m;
}

std::vector<float> to_host(Backend& be, const Tensor& t) {
  std::vector<float> h(static_cast<size_t>(t.numel()));
  if (!h.empty()) be.copy_to_host(h.data(), t.data, h.size() * 4);
  return h;
}

int64_t count_params(ResNetSpec s) {
  ParamStore ps;
  build_resnet(s, ps);
  return ps.num_params();
}

// Compares a ResNet against one PyTorch reference case.
void check_against_pytorch(const std::string& case_name, const ResNetSpec& spec, double tol) {
  RefMap ref = load_ref(case_name);
  auto be = make_backend("cpu");
  ParamStore ps;
  auto model = build_resnet(spec, ps);
  ps.finalize(*be);
  ps.initialize(0);
  ps.import_state([&](const std::string& n) -> std::optional<ImportTensor> {
    auto it = ref.find("state/" + n);
    if (it == ref.end()) return std::nullopt;
    return ImportTensor{it->second.dtype, it->second.shape, it->second.bytes.data(), it->second.bytes.size()};
  }, case_name);

  const RefTensor& in = ref.at("input");
  const RefTensor& lab = ref.at("labels");
  Buffer xb(*be, in.bytes.size()), yb(*be, lab.bytes.size());
  Tensor x = xb.tensor(DType::F32, Shape::from(in.shape.begin(), in.shape.end()));
  Tensor labels = yb.tensor(DType::I32, Shape{lab.shape[0]});
  be->copy_from_host(x.data, in.bytes.data(), in.bytes.size());
  be->copy_from_host(labels.data, lab.bytes.data(), lab.bytes.size());

  Arena arena(*be);
  Ctx ctx{*be, arena, true};
  std::vector<int> ready;
  ctx.grad_ready = [&](int id) { ready.push_back(id); };
  Tensor logits = model->forward(ctx, x);
  SoftmaxCrossEntropy xent(0.1f);
  Tensor losses = xent.forward(ctx, logits, labels);
  model->backward(ctx, xent.backward());
  // every gradient is announced exactly once; the head's come first, the stem's last
  REQUIRE(ready.size() == ps.params().size());
  CHECK(std::set<int>(ready.begin(), ready.end()).size() == ready.size());
  CHECK(ps.params()[size_t(ready.front())].name == "fc.weight");
  CHECK(ps.params()[size_t(ready.back())].name.rfind("conv1.", 0) == 0);

  auto lg = to_host(*be, logits);
  REQUIRE(lg.size() == ref.at("logits").count());
  CHECK(rel_err(lg.data(), ref.at("logits").f32(), lg.size()) < tol);
  CHECK(mean_loss(*be, losses) == doctest::Approx(ref.at("loss").f32()[0]).epsilon(1e-5));

  auto grads = to_host(*be, ps.flat_grads());
  int checked = 0;
  double worst = 0;
  for (const ParamDesc& d : ps.params()) {
    const RefTensor& g = ref.at("grad/" + d.name);
    const size_t n = size_t(d.shape.numel());
    REQUIRE(g.count() == n);
    std::vector<float> ours(n);
    if (d.layout == Layout::OHWI)
      ohwi_to_oihw(grads.data() + d.offset, ours.data(), d.shape);
    else
      std::memcpy(ours.data(), grads.data() + d.offset, n * 4);
    const double e = rel_err(ours.data(), g.f32(), n);
    INFO(case_name << " grad " << d.name << ": relative error " << e);
    CHECK(e < tol);
    worst = std::max(worst, e);
    checked++;
  }
  CHECK(checked == int(ps.params().size()));
  MESSAGE(case_name << ": worst gradient relative error " << worst);
  for (const auto& x2 : ps.export_state()) {
    auto it = ref.find("after/" + x2.name);
    if (it == ref.end()) continue;
    INFO(case_name << " " << x2.name);
    if (x2.dtype == "I64")
      CHECK(std::memcmp(x2.bytes.data(), it->second.bytes.data(), 8) == 0);
    else
      CHECK(rel_err(reinterpret_cast<const float*>(x2.bytes.data()), it->second.f32(), it->second.count()) < tol);
  }
}

}  // namespace

TEST_SUITE("unit") {
TEST_CASE("ResNet parameter counts equal torchvision's") {
  auto spec = [](int depth, std::string stem, int classes) {
    ResNetSpec s;
    s.depth = depth;
    s.stem = stem;
    s.num_classes = classes;
    return s;
  };
  CHECK(count_params(spec(18, "imagenet", 1000)) == 11689512);
  CHECK(count_params(spec(34, "imagenet", 1000)) == 21797672);
  CHECK(count_params(spec(50, "imagenet", 1000)) == 25557032);
  CHECK(count_params(spec(101, "imagenet", 1000)) == 44549160);
  CHECK(count_params(spec(152, "imagenet", 1000)) == 60192808);
  CHECK(count_params(spec(20, "cifar", 10)) == 272474);  // option-B projection shortcuts
  CHECK(count_params(spec(56, "cifar", 10)) == 855770);
  ResNetSpec gray = spec(20, "cifar", 10);
  gray.in_channels = 1;
  CHECK(count_params(gray) == 272474 - 2 * 9 * 16);
}

TEST_CASE("ResNet-18/50 state_dict names / order / dtypes and shapes equal torchvision's") {
  std::ifstream f(ref_dir() + "/names.txt");
  REQUIRE(f.good());
  std::map<std::string, std::vector<StateEntry>> want;
  std::string line;
  while (std::getline(f, line)) {
    std::istringstream ls(line);
    std::string arch;
    StateEntry e;
    ls >> arch >> e.name >> e.dtype;
    int64_t d;
    while (ls >> d) e.shape.push_back(d);
    want[arch].push_back(e);
  }
  for (auto [arch, depth] : {std::pair<std::string, int>{"resnet18", 18}, {"resnet50", 50}}) {
    ParamStore ps;
    ResNetSpec s;
    s.depth = depth;
    build_resnet(s, ps);
    auto got = ps.state_entries();
    REQUIRE(got.size() == want[arch].size());
    for (size_t i = 0; i < got.size(); ++i) {
      INFO(arch << " entry " << i << ": " << got[i].name << " vs " << want[arch][i].name);
      CHECK(got[i].name == want[arch][i].name);
      CHECK(got[i].dtype == want[arch][i].dtype);
      CHECK(got[i].shape == want[arch][i].shape);
    }
  }
}

TEST_CASE("invalid ResNet specs are one-line UserErrors naming the key") {
  ParamStore ps;
  ResNetSpec s;
  s.depth = 20;
  CHECK_THROWS_WITH_AS(build_resnet(s, ps),
                       "model.depth: expected one of 18, 34, 50, 101, 152 for stem = imagenet, got 20",
                       UserError);
  s.stem = "cifar";
  s.depth = 18;
  CHECK_THROWS_WITH_AS(build_resnet(s, ps), doctest::Contains("model.depth: expected 6n+2"), UserError);
  s.stem = "tiny";
  CHECK_THROWS_WITH_AS(build_resnet(s, ps), "model.stem: expected one of imagenet, cifar, got 'tiny'",
                       UserError);
  s.stem = "cifar";
  s.depth = 20;
  s.num_classes = 0;
  CHECK_THROWS_AS(build_resnet(s, ps), UserError);
}

TEST_CASE("zero_init_residual zeroes the last BN weight of every block") {
  auto be = make_backend("cpu");
  for (auto [stem, depth] : {std::pair<std::string, int>{"cifar", 8}, {"imagenet", 50}}) {
    ParamStore ps;
    ResNetSpec s;
    s.stem = stem;
    s.depth = depth;
    s.width = 4;
    s.zero_init_residual = true;
    build_resnet(s, ps);
    ps.finalize(*be);
    ps.initialize(3);
    auto p = to_host(*be, ps.flat_params());
    const std::string last = stem == "cifar" ? ".bn2.weight" : ".bn3.weight";
    int zeroed = 0;
    for (const auto& d : ps.params()) {
      const bool is_last = d.name.size() > last.size() && d.name.compare(d.name.size() - last.size(), last.size(), last) == 0;
      const bool bn_w = d.name.find("bn") != std::string::npos && d.name.find(".weight") != std::string::npos;
      if (!bn_w) continue;
      const float v = p[size_t(d.offset)];
      INFO(d.name);
      CHECK(v == (is_last ? 0.f : 1.f));
      zeroed += is_last;
    }
    CHECK(zeroed == (stem == "cifar" ? 3 : 16));
  }
}

TEST_CASE("CIFAR ResNet-8 matches PyTorch: logits / loss / every gradient / running stats") {
  ResNetSpec s;
  s.stem = "cifar";
  s.depth = 8;
  s.width = 4;
  s.num_classes = 5;
  check_against_pytorch("cifar8", s, 1e-4);
}

TEST_CASE("ResNet-50 (width 4 / ImageNet stem / Bottleneck v1.5) matches PyTorch") {
  ResNetSpec s;
  s.stem = "imagenet";
  s.depth = 50;
  s.width = 4;
  s.num_classes = 7;
  check_against_pytorch("r50w4", s, 1e-3);
}

TEST_CASE("CIFAR ResNet-8 gradients (through BasicBlocks and projections) match finite differences") {
  auto be = make_backend("cpu");
  ParamStore ps;
  ResNetSpec s;
  s.stem = "cifar";
  s.depth = 8;
  s.width = 2;
  s.num_classes = 3;
  auto model = build_resnet(s, ps);
  ps.finalize(*be);
  ps.initialize(5);
  Buffer xb(*be, 4 * 6 * 6 * 3 * 4), yb(*be, 4 * 4);
  Tensor x = xb.tensor(DType::F32, Shape{4, 6, 6, 3});
  Tensor labels = yb.tensor(DType::I32, Shape{4});
  std::vector<float> xh(4 * 6 * 6 * 3);
  Rng r(1);
  for (auto& v : xh) v = r.normal();
  be->copy_from_host(x.data, xh.data(), xh.size() * 4);
  const int32_t lab[4] = {0, 2, 1, 2};
  be->copy_from_host(labels.data, lab, 16);
  Arena arena(*be);
  Ctx ctx{*be, arena, true};
  SoftmaxCrossEntropy xent(0.f);
  auto loss = [&]() {
    arena.reset();
    Tensor lg = model->forward(ctx, x);
    return mean_loss(*be, xent.forward(ctx, lg, labels));
  };
  loss();
  model->backward(ctx, xent.backward());
  auto g = to_host(*be, ps.flat_grads());
  auto p = to_host(*be, ps.flat_params());
  // Central differences at two step sizes; where they disagree the step crossed a ReLU
  // kink (non-smooth point) and the coordinate is skipped, as Caffe's checker does.
  auto numeric = [&](size_t i, double eps) {
    const float orig = p[i];
    p[i] = orig + float(eps);
    be->copy_from_host(ps.flat_params().data, p.data(), p.size() * 4);
    const double lp = loss();
    p[i] = orig - float(eps);
    be->copy_from_host(ps.flat_params().data, p.data(), p.size() * 4);
    const double lm = loss();
    p[i] = orig;
    be->copy_from_host(ps.flat_params().data, p.data(), p.size() * 4);
    return (lp - lm) / (2 * eps);
  };
  int checked = 0, skipped = 0;
  for (const auto& d : ps.params()) {
    for (int64_t k : {int64_t(0), d.shape.numel() / 2, d.shape.numel() - 1}) {
      const size_t i = size_t(d.offset + k);
      const double n1 = numeric(i, 2e-3), n2 = numeric(i, 1e-3);
      if (std::fabs(n1 - n2) > 1e-3 + 0.02 * std::fabs(n2)) {
        skipped++;
        continue;
      }
      INFO(d.name << "[" << k << "]: analytic " << g[i] << " numeric " << n2);
      CHECK(std::fabs(n2 - g[i]) <= 1e-3 + 1e-2 * std::fabs(n2));
      checked++;
    }
  }
  MESSAGE(checked << " coordinates checked by finite differences, " << skipped << " skipped at kinks");
  CHECK(skipped * 5 <= checked);
}

TEST_CASE("a tiny ResNet overfits a fixed batch with SGD (20 steps)") {
  auto be = make_backend("cpu");
  ParamStore ps;
  ResNetSpec s;
  s.stem = "cifar";
  s.depth = 8;
  s.width = 8;
  s.num_classes = 10;
  auto model = build_resnet(s, ps);
  ps.finalize(*be);
  ps.initialize(42);
  SgdConfig oc;
  oc.momentum = 0.9f;
  oc.weight_decay = 5e-4f;
  Sgd opt(ps, oc);
  const int n = 16;
  Buffer xb(*be, n * 8 * 8 * 3 * 4), yb(*be, n * 4);
  Tensor x = xb.tensor(DType::F32, Shape{n, 8, 8, 3});
  Tensor labels = yb.tensor(DType::I32, Shape{n});
  std::vector<float> xh(size_t(x.numel()));
  Rng r(2);
  for (auto& v : xh) v = r.normal();
  std::vector<int32_t> lab(n);
  for (auto& l : lab) l = int32_t(r.below(10));
  be->copy_from_host(x.data, xh.data(), xh.size() * 4);
  be->copy_from_host(labels.data, lab.data(), lab.size() * 4);
  Arena arena(*be);
  Ctx ctx{*be, arena, true};
  SoftmaxCrossEntropy xent;
  std::vector<double> losses;
  for (int step = 0; step < 20; ++step) {
    ps.zero_grads();
    Tensor lg = model->forward(ctx, x);
    Tensor l = xent.forward(ctx, lg, labels);
    losses.push_back(mean_loss(*be, l));
    model->backward(ctx, xent.backward());
    opt.step(0.05f, 1.f);
    arena.reset();
  }
  MESSAGE("tiny ResNet overfit: loss " << losses.front() << " -> " << losses.back());
  CHECK(std::isfinite(losses.back()));
  CHECK(losses.back() < 0.3 * losses.front());
  CHECK(arena.device_allocations() <= 2);  // steady state allocates nothing new
}
}
