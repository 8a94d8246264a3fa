// U-Net: ConvTranspose2d layer vs a naive reference and finite differences, spec
// validation, state names vs an equivalent PyTorch module, logits and every gradient vs
// PyTorch (float64) for both upsampling modes, finite differences through a whole tiny
// U-Net, overfitting a fixed batch (cross-entropy and Dice), and segmentation metrics.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <unistd.h>

#include "core/error.h"
#include "gradcheck.h"
#include "models/unet.h"
#include "nn/seg_metrics.h"
#include "nn/unet_layers.h"
#include "op_harness.h"

using namespace dtrain;
using testing::dot;
using testing::HostDev;
using testing::HostVec;
using testing::random_vec;
namespace fs = std::filesystem;

namespace {

const char* kRefScript = R"PY(
import sys, numpy as np, torch, torch.nn as nn, torch.nn.functional as F
d = sys.argv[1]
depth, base, inch, K, N, H, W = [int(v) for v in sys.argv[2:9]]
mode = sys.argv[9]
def dc(i, o):
    return nn.Sequential(nn.Conv2d(i, o, 3, 1, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True),
                         nn.Conv2d(o, o, 3, 1, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True))
class DC(nn.Module):
    def __init__(s, i, o): super().__init__(); s.conv = dc(i, o)
    def forward(s, x): return s.conv(x)
class Up(nn.Module):
    def __init__(s, i, o):
        super().__init__()
        s.up = nn.ConvTranspose2d(i, o, 2, 2) if mode == 'transpose' else nn.Sequential(
            nn.Upsample(scale_factor=2, mode='bilinear', align_corners=False), nn.Conv2d(i, o, 3, 1, 1))
        s.conv = DC(2 * o, o)
    def forward(s, x, skip): return s.conv(torch.cat([skip, s.up(x)], 1))
class UNet(nn.Module):
    def __init__(s):
        super().__init__()
        c = lambda i: base << i
        s.down = nn.ModuleList([DC(inch if i == 0 else c(i - 1), c(i)) for i in range(depth)])
        s.bottleneck = DC(c(depth - 1), c(depth))
        s.up = nn.ModuleList([Up(c(depth - j), c(depth - 1 - j)) for j in range(depth)])
        s.head = nn.Conv2d(base, K, 1)
    def forward(s, x):
        skips = []
        for m in s.down:
            x = m(x); skips.append(x); x = F.max_pool2d(x, 2)
        x = s.bottleneck(x)
        for j, m in enumerate(s.up): x = m(x, skips[depth - 1 - j])
        return s.head(x)
net = UNet().double().train()
sd = net.state_dict()
with open(d + '/torch_names.txt', 'w') as f:
    for k, v in sd.items(): f.write(' '.join([k] + [str(x) for x in v.shape]) + '\n')
blob = open(d + '/state.bin', 'rb').read()
new = {}
for line in open(d + '/state.txt'):
    name, dt, off, nb, *shape = line.split()
    arr = np.frombuffer(blob[int(off):int(off) + int(nb)], dtype=np.float32 if dt == 'F32' else np.int64)
    new[name] = torch.from_numpy(arr.copy()).reshape([int(x) for x in shape])
net.load_state_dict({k: (v.double() if v.is_floating_point() else v) for k, v in new.items()})
x = torch.from_numpy(np.fromfile(d + '/x.bin', dtype=np.float32)).double().reshape(N, H, W, inch).permute(0, 3, 1, 2)
r = torch.from_numpy(np.fromfile(d + '/r.bin', dtype=np.float32)).double().reshape(N, H, W, K)
y = net(x).permute(0, 2, 3, 1)
(y * r).sum().backward()
out = [y.detach().numpy().ravel()]
params = dict(net.named_parameters())
for name in open(d + '/grads.txt').read().split():
    out.append(params[name].grad.numpy().ravel())
np.concatenate(out).astype(np.float64).tofile(d + '/out.bin')
)PY";

struct TmpDir {
  fs::path p;
  TmpDir() {
    p = fs::temp_directory_path() / ("dtrain_unet_" + std::to_string(getpid()) + "_" +
                                     std::to_string(rand()));
    fs::create_directories(p);
  }
  ~TmpDir() { std::error_code ec; fs::remove_all(p, ec); }
};

void write_bin(const fs::path& p, const void* data, size_t n) {
  std::ofstream f(p, std::ios::binary);
  f.write(static_cast<const char*>(data), std::streamsize(n));
}

double rel(const std::vector<double>& a, const std::vector<double>& b) {
  double e = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i) e = std::max(e, std::abs(a[i] - b[i])), m = std::max(m, std::abs(b[i]));
  return e / std::max(m, 1e-30);
}

struct Rig {
  std::unique_ptr<Backend> be = make_backend("cpu", 0, 2);
  ParamStore ps;
  std::unique_ptr<Model> model;
  Rig(const UNetSpec& s, uint64_t seed = 0) {
    model = build_unet(s, ps);
    ps.finalize(*be);
    ps.initialize(seed);
  }
};

void check_vs_pytorch(const UNetSpec& s) {
  const int N = 2, H = 16, W = 16;
  Rig rig(s, 3);
  TmpDir tmp;
  // weights: randomise BN affine params too, so they are exercised
  {
    auto flat = std::vector<float>(size_t(rig.ps.num_params()));
    rig.be->copy_to_host(flat.data(), rig.ps.flat_params().data, flat.size() * 4);
    auto rnd = random_vec(flat.size(), 11, -0.3f, 0.3f);
    for (const ParamDesc& d : rig.ps.params())
      if (d.name.find(".conv.1.") != std::string::npos || d.name.find(".conv.4.") != std::string::npos)
        for (int64_t i = 0; i < d.shape.numel(); ++i)
          flat[size_t(d.offset + i)] += rnd[size_t(d.offset + i)];
    rig.be->copy_from_host(rig.ps.flat_params().data, flat.data(), flat.size() * 4);
  }
  std::ofstream man(tmp.p / "state.txt");
  std::string blob;
  for (const auto& e : rig.ps.export_state()) {
    man << e.name << " " << e.dtype << " " << blob.size() << " " << e.bytes.size();
    for (auto d : e.shape) man << " " << d;
    man << "\n";
    blob.append(reinterpret_cast<const char*>(e.bytes.data()), e.bytes.size());
  }
  man.close();
  write_bin(tmp.p / "state.bin", blob.data(), blob.size());
  std::ofstream gl(tmp.p / "grads.txt");
  for (const ParamDesc& d : rig.ps.params()) gl << d.name << "\n";
  gl.close();
  HostVec x = random_vec(size_t(N * H * W * s.in_channels), 5);
  HostVec r = random_vec(size_t(N * H * W * s.num_classes), 6);
  write_bin(tmp.p / "x.bin", x.data(), x.size() * 4);
  write_bin(tmp.p / "r.bin", r.data(), r.size() * 4);
  fs::path script = tmp.p / "ref.py";
  { std::ofstream(script) << kRefScript; }
  std::string cmd = std::string(DTRAIN_SOURCE_DIR "/.venv/bin/python ") + script.string() + " " +
                    tmp.p.string() + " " + std::to_string(s.depth) + " " +
                    std::to_string(s.base_channels) + " " + std::to_string(s.in_channels) + " " +
                    std::to_string(s.num_classes) + " 2 16 16 " + s.upsample;
  REQUIRE_MESSAGE(std::system(cmd.c_str()) == 0, cmd);

  // names and PyTorch shapes
  std::map<std::string, std::vector<int64_t>> torch_names;
  std::ifstream tn(tmp.p / "torch_names.txt");
  for (std::string line; std::getline(tn, line);) {
    std::istringstream is(line);
    std::string n;
    is >> n;
    std::vector<int64_t> sh;
    for (int64_t v; is >> v;) sh.push_back(v);
    torch_names[n] = sh;
  }
  auto entries = rig.ps.state_entries();
  CHECK(entries.size() == torch_names.size());
  for (const auto& e : entries) {
    INFO(e.name);
    REQUIRE(torch_names.count(e.name) == 1);
    CHECK(torch_names[e.name] == e.shape);
  }

  HostDev d(*rig.be);
  Tensor tx = d.up(x, {N, H, W, s.in_channels}), tr = d.up(r, {N, H, W, s.num_classes});
  Arena arena(*rig.be);
  Ctx ctx{*rig.be, arena, true};
  Tensor y = rig.model->forward(ctx, tx);
  REQUIRE(y.shape == Shape{N, H, W, s.num_classes});
  rig.model->backward(ctx, tr);

  std::ifstream of(tmp.p / "out.bin", std::ios::binary);
  std::vector<double> ref((std::istreambuf_iterator<char>(of)), {});
  of.close();
  std::ifstream of2(tmp.p / "out.bin", std::ios::binary | std::ios::ate);
  const size_t nref = size_t(of2.tellg()) / 8;
  of2.seekg(0);
  ref.assign(nref, 0);
  of2.read(reinterpret_cast<char*>(ref.data()), std::streamsize(nref * 8));
  REQUIRE(nref == size_t(y.numel() + rig.ps.num_params()));
  HostVec yl = d.down(y);
  std::vector<double> ours(yl.begin(), yl.end()), want(ref.begin(), ref.begin() + y.numel());
  CHECK_MESSAGE(rel(ours, want) < 1e-4, "logits rel err " << rel(ours, want));
  HostVec g = d.down(rig.ps.flat_grads());
  size_t off = size_t(y.numel());
  double worst = 0;
  for (const ParamDesc& pd : rig.ps.params()) {
    const size_t n = size_t(pd.shape.numel());
    HostVec mine(n);
    if (pd.layout == Layout::OHWI)
      ohwi_to_oihw(g.data() + pd.offset, mine.data(), pd.shape);
    else
      std::memcpy(mine.data(), g.data() + pd.offset, n * 4);
    std::vector<double> a(mine.begin(), mine.end()), b(ref.begin() + long(off), ref.begin() + long(off + n));
    off += n;
    const double e = rel(a, b);
    worst = std::max(worst, e);
    CHECK_MESSAGE(e < 1e-4, pd.name << " grad rel err " << e);
  }
  MESSAGE("unet " << s.upsample << ": worst gradient relative error " << worst);
}

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("ConvTranspose2d: naive reference and finite differences") {
  auto be = make_backend("cpu", 0, 2);
  ParamStore ps;
  const int N = 2, H = 3, W = 4, Ci = 3, Co = 5;
  ConvTranspose2d ct(ps, "up", Ci, Co, 2, 2, true);
  ps.finalize(*be);
  ps.initialize(1);
  HostDev d(*be);
  Arena arena(*be);
  Ctx ctx{*be, arena, true};
  HostVec x = random_vec(size_t(N * H * W * Ci), 2);
  Tensor tx = d.up(x, {N, H, W, Ci});
  Tensor y = ct.forward(ctx, tx);
  REQUIRE(y.shape == Shape{N, 2 * H, 2 * W, Co});
  // naive: y[n, 2h+i, 2w+j, o] = b[o] + sum_c x[n,h,w,c] * Wt[c, o, i, j] (PyTorch layout)
  HostVec wi = d.down(ps.param(ct.weight_id())), b = d.down(ps.param(ct.bias_id()));
  HostVec wt(wi.size());
  ohwi_to_oihw(wi.data(), wt.data(), Shape{Ci, 2, 2, Co});
  HostVec want(size_t(y.numel()));
  for (int n = 0; n < N; ++n)
    for (int h = 0; h < H; ++h)
      for (int w = 0; w < W; ++w)
        for (int i = 0; i < 2; ++i)
          for (int j = 0; j < 2; ++j)
            for (int o = 0; o < Co; ++o) {
              double s = b[size_t(o)];
              for (int c = 0; c < Ci; ++c)
                s += double(x[size_t(((n * H + h) * W + w) * Ci + c)]) * wt[size_t(((c * Co + o) * 2 + i) * 2 + j)];
              want[size_t(((n * 2 * H + 2 * h + i) * 2 * W + 2 * w + j) * Co + o)] = float(s);
            }
  EXPECT_CLOSE(d.down(y), want, 1e-5);
  // gradients
  HostVec r = random_vec(size_t(y.numel()), 3);
  Tensor tr = d.up(r, y.shape);
  ps.zero_grads();
  Tensor dx = ct.backward(ctx, tr);
  HostVec gdx = d.down(dx), gw = d.down(ps.grad(ct.weight_id())), gb = d.down(ps.grad(ct.bias_id()));
  auto loss = [&] {
    d.set(tx, x);
    Tensor yy = ct.forward(ctx, tx);
    return dot(d.down(yy), r);
  };
  auto rx = testing::check_gradient(loss, x, gdx);
  CHECK_MESSAGE(rx.ok, "dx " << rx.summary());
  Tensor pw = ps.param(ct.weight_id()), pb = ps.param(ct.bias_id());
  auto lw = [&] {
    d.set(pw, wi);
    Tensor yy = ct.forward(ctx, tx);
    return dot(d.down(yy), r);
  };
  d.set(tx, x);
  auto rw = testing::check_gradient(lw, wi, gw);
  CHECK_MESSAGE(rw.ok, "dw " << rw.summary());
  auto lb = [&] {
    d.set(pb, b);
    Tensor yy = ct.forward(ctx, tx);
    return dot(d.down(yy), r);
  };
  auto rb = testing::check_gradient(lb, b, gb);
  CHECK_MESSAGE(rb.ok, "db " << rb.summary());
}

TEST_CASE("U-Net: spec validation and input size") {
  ParamStore ps;
  UNetSpec s{2, 4, 3, 3, "transpose"};
  CHECK_THROWS_AS(build_unet(UNetSpec{0, 4, 3, 3, "transpose"}, ps), UserError);
  CHECK_THROWS_AS(build_unet(UNetSpec{2, 4, 3, 3, "nearest"}, ps), UserError);
  CHECK_THROWS_AS(build_unet(UNetSpec{2, 4, 3, 0, "bilinear"}, ps), UserError);
  Rig rig(s);
  HostDev d(*rig.be);
  Arena arena(*rig.be);
  Ctx ctx{*rig.be, arena, true};
  Tensor x = d.zeros({1, 10, 16, 3});
  CHECK_THROWS_AS(rig.model->forward(ctx, x), UserError);
}

TEST_CASE("U-Net vs PyTorch (transpose and bilinear upsampling)") {
  check_vs_pytorch(UNetSpec{2, 4, 3, 3, "transpose"});
  check_vs_pytorch(UNetSpec{2, 4, 2, 4, "bilinear"});
}

TEST_CASE("U-Net: finite differences through the whole network") {
  UNetSpec s{2, 4, 3, 3, "bilinear"};
  Rig rig(s, 7);
  HostDev d(*rig.be);
  const int N = 2, H = 16, W = 16;
  HostVec x = random_vec(size_t(N * H * W * 3), 1), r = random_vec(size_t(N * H * W * 3), 2);
  Tensor tx = d.up(x, {N, H, W, 3}), tr = d.up(r, {N, H, W, 3});
  Arena arena(*rig.be);
  Ctx ctx{*rig.be, arena, true};
  rig.model->forward(ctx, tx);
  rig.model->backward(ctx, tr);
  HostVec g = d.down(rig.ps.flat_grads());
  HostVec p = d.down(rig.ps.flat_params());
  auto loss = [&] {
    arena.reset();
    Tensor fp = rig.ps.flat_params();
    d.set(fp, p);
    Tensor y = rig.model->forward(ctx, tx);
    return dot(d.down(y), r);
  };
  testing::GradCheckOptions o;
  // f32 network, BN batch statistics and ReLU/max-pool kinks: loose bounds here; every
  // gradient is checked against PyTorch at 1e-4 above.
  o.eps = 3e-3;
  o.threshold = 0.1;
  o.kink_threshold = 0.1;
  o.max_checks = 80;
  auto res = testing::check_gradient(loss, p, g, o);
  CHECK_MESSAGE(res.ok, res.summary());
  CHECK(res.checked >= 20);
}

TEST_CASE("U-Net: overfits a fixed batch (cross-entropy / then Dice)") {
  for (int use_dice = 0; use_dice < 2; ++use_dice) {
    UNetSpec s{2, 8, 1, 3, use_dice ? "bilinear" : "transpose"};
    Rig rig(s, 1);
    HostDev d(*rig.be);
    const int N = 2, H = 16, W = 16, K = 3;
    const int64_t P = N * H * W;
    HostVec x(static_cast<size_t>(P));
    std::vector<int32_t> lab(static_cast<size_t>(P));
    auto noise = random_vec(size_t(P), 4, -0.2f, 0.2f);
    for (int n = 0; n < N; ++n)
      for (int h = 0; h < H; ++h)
        for (int w = 0; w < W; ++w) {
          const size_t i = size_t((n * H + h) * W + w);
          const int cls = (h - 8) * (h - 8) + (w - 6 - 3 * n) * (w - 6 - 3 * n) < 16 ? 1 : (h > 11 && w > 10 ? 2 : 0);
          lab[i] = cls;
          x[i] = float(cls) * 0.5f + noise[i];
        }
    Tensor tx = d.up(x, {N, H, W, 1});
    Tensor tl = d.empty(DType::I32, {N, H, W});
    rig.be->copy_from_host(tl.data, lab.data(), lab.size() * 4);
    Tensor losses = d.zeros({P}), dl = d.zeros({P, K});
    Tensor m = d.zeros({rig.ps.num_params()}), v = d.zeros({rig.ps.num_params()});
    Arena arena(*rig.be);
    Ctx ctx{*rig.be, arena, true};
    double first = 0, last = 0;
    for (int step = 1; step <= 40; ++step) {
      arena.reset();
      rig.ps.zero_grads();
      Tensor y = rig.model->forward(ctx, tx);
      Tensor y2 = y.view(Shape{P, K});
      Tensor dy = dl.view(y.shape);
      double L;
      if (use_dice) {
        L = testing::softmax_dice_host(*rig.be, y, tl, 1.f, 1.f, dy);
      } else {
        rig.be->softmax_xent(y2, tl, 0.f, 1.f / float(P), losses, dl);
        HostVec lv = d.down(losses);
        L = 0;
        for (float e : lv) L += e;
        L /= double(P);
      }
      if (step == 1) first = L;
      last = L;
      rig.model->backward(ctx, dy);
      AdamWArgs a;
      a.lr = 1e-2f, a.weight_decay = 0.f, a.step = step;
      Tensor fp = rig.ps.flat_params();
      rig.be->adamw_step(fp, rig.ps.flat_grads(), m, v, rig.ps.segments(true), a);
    }
    MESSAGE((use_dice ? "dice" : "xent") << " loss " << first << " -> " << last);
    CHECK(last < 0.2 * first);
    // predictions match the labels almost everywhere
    arena.reset();
    Tensor y = rig.model->forward(ctx, tx);
    SegConfusion conf(K);
    HostVec yl = d.down(y);
    conf.add_logits(yl.data(), lab.data(), P);
    SegScores sc = seg_scores(conf);
    MESSAGE("pixel accuracy " << sc.pixel_accuracy << " mIoU " << sc.mean_iou);
    CHECK(sc.pixel_accuracy > 0.95);
  }
}

TEST_CASE("segmentation metrics on a hand-made example") {
  // labels: 0 0 1 1 2 2 ; preds: 0 1 1 1 2 0
  SegConfusion c(4);
  std::vector<int32_t> lab = {0, 0, 1, 1, 2, 2}, pred = {0, 1, 1, 1, 2, 0};
  c.add_predictions(pred.data(), lab.data(), 6);
  SegScores s = seg_scores(c);
  // class 0: tp 1 fp 1 fn 1 -> IoU 1/3, Dice 1/2; class 1: tp 2 fp 1 fn 0 -> 2/3, 4/5;
  // class 2: tp 1 fp 0 fn 1 -> 1/2, 2/3; class 3 absent -> NaN, excluded
  CHECK(s.iou[0] == doctest::Approx(1.0 / 3));
  CHECK(s.iou[1] == doctest::Approx(2.0 / 3));
  CHECK(s.iou[2] == doctest::Approx(0.5));
  CHECK(std::isnan(s.iou[3]));
  CHECK(s.dice[0] == doctest::Approx(0.5));
  CHECK(s.dice[1] == doctest::Approx(0.8));
  CHECK(s.dice[2] == doctest::Approx(2.0 / 3));
  CHECK(s.mean_iou == doctest::Approx((1.0 / 3 + 2.0 / 3 + 0.5) / 3));
  CHECK(s.mean_dice == doctest::Approx((0.5 + 0.8 + 2.0 / 3) / 3));
  CHECK(s.pixel_accuracy == doctest::Approx(4.0 / 6));
  // logits path: argmax
  SegConfusion c2(2);
  std::vector<float> lg = {2, 1, 0, 3};
  std::vector<int32_t> l2 = {0, 0};
  c2.add_logits(lg.data(), l2.data(), 2);
  CHECK(c2.at(0, 0) == 1);
  CHECK(c2.at(0, 1) == 1);
  std::vector<int32_t> badl = {5};
  CHECK_THROWS_AS(c2.add_predictions(pred.data(), badl.data(), 1), UserError);
}

}  // TEST_SUITE("unit")
