// The U-Net decoder's convolution over cat(skip, up) without the concatenation
// (Module::forward_cat / backward_cat, Conv2d's Op::Conv2dCat path) checked end to end on the
// CPU: a test double of the CPU backend that claims Op::Conv2dCat and implements it the way
// CUDA does (the filter split in two halves, two convolutions summed; the input gradients as
// the two parts; the filter gradient as two halves joined), against the plain CPU backend,
// which concatenates. Same U-Net, same weights and batch: the logits, every parameter
// gradient and the batch-norm statistics must agree (up to the two sums' order).
#include <doctest/doctest.h>

#include <memory>

#include "backend/cpu/cpu_backend.h"
#include "core/buffer.h"
#include "models/unet.h"
#include "gradcheck.h"
#include "op_harness.h"

using namespace dtrain;
using testing::HostDev;
using testing::HostVec;

namespace {

class SplitCatCpu : public CpuBackend {
 public:
  SplitCatCpu() : CpuBackend(2) {}
  bool supports(Op op, DType t) const override { return op == Op::Conv2dCat || CpuBackend::supports(op, t); }

  void conv2d_fwd_cat(const Tensor& a, const Tensor& b, const Tensor& w, Tensor& y, const Conv2dParams& p) override {
    ++fwd;
    auto [wa, wb] = halves(w, a.dim(3), b.dim(3));
    Tensor none;
    conv2d_fwd(a, wa.t, none, y, p);
    Buffer tb(*this, y.nbytes());
    Tensor t = tb.tensor(y.dtype, y.shape);
    conv2d_fwd(b, wb.t, none, t, p);
    add(y, t, y);
  }
  void conv2d_bwd_data_cat(const Tensor& dy, const Tensor& w, Tensor& da, Tensor& db,
                           const Conv2dParams& p) override {
    ++bwd_data;
    auto [wa, wb] = halves(w, da.dim(3), db.dim(3));
    conv2d_bwd_data(dy, wa.t, da, p, false);
    conv2d_bwd_data(dy, wb.t, db, p, false);
  }
  void conv2d_bwd_filter_cat(const Tensor& a, const Tensor& b, const Tensor& dy, Tensor& dw, const Conv2dParams& p,
                             bool accumulate) override {
    ++bwd_filter;
    const int64_t rows = dw.numel() / dw.dim(3);
    Owned ga(*this, dw.dtype, {dw.dim(0), dw.dim(1), dw.dim(2), a.dim(3)});
    Owned gb(*this, dw.dtype, {dw.dim(0), dw.dim(1), dw.dim(2), b.dim(3)});
    Owned j(*this, dw.dtype, dw.shape);
    Tensor none;
    conv2d_bwd_filter(a, dy, ga.t, none, p, false);
    conv2d_bwd_filter(b, dy, gb.t, none, p, false);
    Tensor j2 = j.t.view({rows, dw.dim(3)});
    concat_channels(ga.t.view({rows, a.dim(3)}), gb.t.view({rows, b.dim(3)}), j2);
    if (accumulate)
      add(dw, j.t, dw);
    else
      copy(j.t, dw);
  }
  int fwd = 0, bwd_data = 0, bwd_filter = 0;

 private:
  struct Owned {
    Buffer buf;
    Tensor t;
    Owned(Backend& be, DType dt, Shape s) : buf(be, size_t(s.numel()) * dtype_size(dt)), t(buf.tensor(dt, s)) {}
  };
  std::pair<Owned, Owned> halves(const Tensor& w, int64_t ca, int64_t cb) {
    const int64_t rows = w.numel() / w.dim(3);
    Owned wa(*this, w.dtype, {w.dim(0), w.dim(1), w.dim(2), ca}), wb(*this, w.dtype, {w.dim(0), w.dim(1), w.dim(2), cb});
    Tensor a2 = wa.t.view({rows, ca}), b2 = wb.t.view({rows, cb});
    split_channels(w.view({rows, ca + cb}), a2, b2);
    return {std::move(wa), std::move(wb)};
  }
};

struct Net {
  std::unique_ptr<Backend> be;
  ParamStore ps;
  std::unique_ptr<Model> model;
  std::unique_ptr<Arena> arena;
  Net(std::unique_ptr<Backend> b, const UNetSpec& s) : be(std::move(b)) {
    model = build_unet(s, ps);
    ps.finalize(*be);
    ps.initialize(7);
    arena = std::make_unique<Arena>(*be);
  }
  // one training forward + backward of a fixed batch: the logits
  HostVec step(const HostVec& x, const Shape& xs, const HostVec& dlogits) {
    HostDev d(*be);
    Ctx ctx{*be, *arena, true, {}};
    Tensor y = model->forward(ctx, d.up(x, xs));
    HostVec out = d.down(y);
    model->backward(ctx, d.up(dlogits, y.shape));
    return out;
  }
  HostVec grads() {
    HostDev d(*be);
    return d.down(ps.flat_grads());
  }
  HostVec buffers() {
    HostDev d(*be);
    return d.down(ps.flat_buffers());
  }
};

}  // namespace

TEST_SUITE("unit") {
TEST_CASE("U-Net decoder: the split-filter convolution over cat(skip up) equals concatenate then convolve") {
  for (const char* up : {"transpose", "bilinear"}) {
    CAPTURE(up);
    UNetSpec s;
    s.depth = 2;
    s.base_channels = 4;
    s.in_channels = 3;
    s.num_classes = 3;
    s.upsample = up;
    auto split = std::make_unique<SplitCatCpu>();
    SplitCatCpu* sp = split.get();
    Net ref(make_backend("cpu", 0, 2), s), cat(std::move(split), s);
    const Shape xs{2, 8, 8, 3};
    const HostVec x = testing::random_vec(size_t(xs.numel()), 21);
    const HostVec dl = testing::random_vec(size_t(2 * 8 * 8 * 3), 22);
    const HostVec y_ref = ref.step(x, xs, dl), y_cat = cat.step(x, xs, dl);
    // every decoder level went through the backend's concatenation-free ops
    CHECK(sp->fwd == s.depth);
    CHECK(sp->bwd_data == s.depth);
    CHECK(sp->bwd_filter == s.depth);
    CHECK(testing::nerr(y_cat, y_ref) < 1e-5);
    CHECK(testing::nerr(cat.grads(), ref.grads()) < 1e-5);
    CHECK(testing::nerr(cat.buffers(), ref.buffers()) < 1e-5);
    CHECK_FALSE(testing::all_zero(cat.grads()));
  }
}
}  // TEST_SUITE("unit")
