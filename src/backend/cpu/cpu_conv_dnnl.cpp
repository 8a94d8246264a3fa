// oneDNN convolution for CpuBackend. Data tensors are passed as nhwc; weights are OHWI
// (oneDNN's ohwi tag) in our buffers, and oneDNN picks its preferred weights layout
// (format `any`): forward and backward-data reorder OHWI into it, backward-weights computes
// into it and reorders back (with a sum post-op when accumulating). One engine and stream
// per backend; primitives, memory objects and reorders are cached per geometry, so the
// steady state creates nothing.
#include <oneapi/dnnl/dnnl.hpp>

#include <array>
#include <cstring>
#include <string>
#include <unordered_map>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_conv.h"
#include "core/error.h"

namespace dtrain::cpu {

using dnnl::memory;
using tag = memory::format_tag;
using dt = memory::data_type;

namespace {

struct Key {
  std::array<int64_t, 16> v{};
  bool operator==(const Key& o) const { return v == o.v; }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t x : k.v) h = (h ^ uint64_t(x)) * 1099511628211ull;
    return size_t(h);
  }
};
Key make_key(const ConvDims& d) {
  return Key{{d.N, d.H, d.W, d.C, d.O, d.KH, d.KW, d.OH, d.OW, d.p.stride_h, d.p.stride_w,
              d.p.pad_h, d.p.pad_w, d.p.dil_h, d.p.dil_w, d.has_bias ? 1 : 0}};
}

struct Descs {
  memory::desc src, wts_user, wts_any, bias, dst;
  memory::dims strides, dilates, pad_l, pad_r;
};
Descs make_descs(const ConvDims& d) {
  Descs s;
  s.src = memory::desc({d.N, d.C, d.H, d.W}, dt::f32, tag::nhwc);
  s.dst = memory::desc({d.N, d.O, d.OH, d.OW}, dt::f32, tag::nhwc);
  s.wts_user = memory::desc({d.O, d.C, d.KH, d.KW}, dt::f32, tag::ohwi);
  s.wts_any = memory::desc({d.O, d.C, d.KH, d.KW}, dt::f32, tag::any);
  s.bias = d.has_bias ? memory::desc({d.O}, dt::f32, tag::x) : memory::desc();
  s.strides = {d.p.stride_h, d.p.stride_w};
  s.dilates = {d.p.dil_h - 1, d.p.dil_w - 1};
  s.pad_l = {d.p.pad_h, d.p.pad_w};
  s.pad_r = {d.p.pad_h, d.p.pad_w};  // symmetric, as PyTorch: oneDNN floors the output size too
  return s;
}

dnnl::convolution_forward::primitive_desc fwd_pd(const Descs& s, const dnnl::engine& eng) {
  dnnl::convolution_forward::desc cd(dnnl::prop_kind::forward_training,
                                     dnnl::algorithm::convolution_direct, s.src, s.wts_any,
                                     s.bias, s.dst, s.strides, s.dilates, s.pad_l, s.pad_r);
  return dnnl::convolution_forward::primitive_desc(cd, eng);
}

struct FwdEntry {
  bool ok = true;
  dnnl::convolution_forward prim;
  memory src, wts_user, wts, bias, dst;
  dnnl::reorder wts_reorder;  // only when wts differs from OHWI
  bool reorder_w = false;
};
struct BwdDataEntry {
  bool ok = true;
  dnnl::convolution_backward_data prim;
  memory diff_src, wts_user, wts, diff_dst;
  dnnl::reorder wts_reorder;
  bool reorder_w = false;
};
struct BwdWeightsEntry {
  bool ok = true;
  dnnl::convolution_backward_weights prim;
  memory src, diff_dst, diff_wts, diff_wts_user, diff_bias;
  dnnl::reorder to_user, to_user_sum;  // when diff_wts is not OHWI or when accumulating
  bool direct = false;                 // diff_wts is OHWI: no reorder when overwriting
  std::vector<float> bias_buf;
};

}  // namespace

struct ConvCache {
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm{eng};
  std::unordered_map<Key, FwdEntry, KeyHash> fwd;
  std::unordered_map<Key, BwdDataEntry, KeyHash> bwd_data;
  std::unordered_map<Key, BwdWeightsEntry, KeyHash> bwd_w;
  std::string impl[3];
};

ConvCache* conv_cache_new() { return new ConvCache(); }
void conv_cache_delete(ConvCache* c) { delete c; }
int64_t conv_cache_plans(const ConvCache& c) { return int64_t(c.fwd.size() + c.bwd_data.size() + c.bwd_w.size()); }
const char* dnnl_impl_name(ConvCache& c, int kind) { return c.impl[kind].c_str(); }

namespace {
// Creates a cache entry; an entry oneDNN has no implementation for stays marked !ok and the
// caller falls back to im2col.
template <typename E, typename F>
E& entry(std::unordered_map<Key, E, KeyHash>& map, const ConvDims& d, F make) {
  Key k = make_key(d);
  auto it = map.find(k);
  if (it != map.end()) return it->second;
  E e;
  try {
    make(e);
  } catch (const dnnl::error& err) {
    if (err.status != dnnl_unimplemented) throw;
    e = E();
    e.ok = false;
  }
  return map.emplace(k, std::move(e)).first->second;
}

template <typename F>
auto wrap(const char* op, const ConvDims& d, F&& f) {
  try {
    return f();
  } catch (const dnnl::error& e) {
    fault("cpu backend: {} (oneDNN): {} for x [{},{},{},{}] w [{},{},{},{}] stride {}x{} pad "
          "{}x{} dil {}x{}",
          op, e.what(), d.N, d.H, d.W, d.C, d.O, d.KH, d.KW, d.C, d.p.stride_h, d.p.stride_w,
          d.p.pad_h, d.p.pad_w, d.p.dil_h, d.p.dil_w);
  }
}
}  // namespace

bool dnnl_conv_fwd(ConvCache& c, const ConvDims& d, const float* x, const float* w,
                   const float* b, float* y) {
  return wrap("conv2d_fwd", d, [&] {
    FwdEntry& e = entry(c.fwd, d, [&](FwdEntry& e) {
      Descs s = make_descs(d);
      auto pd = fwd_pd(s, c.eng);
      e.prim = dnnl::convolution_forward(pd);
      e.src = memory(s.src, c.eng, DNNL_MEMORY_NONE);
      e.dst = memory(s.dst, c.eng, DNNL_MEMORY_NONE);
      e.wts_user = memory(s.wts_user, c.eng, DNNL_MEMORY_NONE);
      if (d.has_bias) e.bias = memory(s.bias, c.eng, DNNL_MEMORY_NONE);
      e.reorder_w = pd.weights_desc() != s.wts_user;
      if (e.reorder_w) {
        e.wts = memory(pd.weights_desc(), c.eng);
        e.wts_reorder = dnnl::reorder(e.wts_user, e.wts);
      }
      c.impl[0] = pd.impl_info_str();
    });
    if (!e.ok) return false;
    e.src.set_data_handle(const_cast<float*>(x));
    e.dst.set_data_handle(y);
    e.wts_user.set_data_handle(const_cast<float*>(w));
    if (e.reorder_w) e.wts_reorder.execute(c.strm, e.wts_user, e.wts);
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, e.src},
                                         {DNNL_ARG_WEIGHTS, e.reorder_w ? e.wts : e.wts_user},
                                         {DNNL_ARG_DST, e.dst}};
    if (d.has_bias) {
      e.bias.set_data_handle(const_cast<float*>(b));
      args[DNNL_ARG_BIAS] = e.bias;
    }
    e.prim.execute(c.strm, args);
    c.strm.wait();
    return true;
  });
}

bool dnnl_conv_bwd_data(ConvCache& c, const ConvDims& d, const float* dy, const float* w,
                        float* dx) {
  return wrap("conv2d_bwd_data", d, [&] {
    BwdDataEntry& e = entry(c.bwd_data, d, [&](BwdDataEntry& e) {
      Descs s = make_descs(d);
      auto hint = fwd_pd(s, c.eng);
      dnnl::convolution_backward_data::desc bd(dnnl::algorithm::convolution_direct, s.src,
                                               s.wts_any, s.dst, s.strides, s.dilates, s.pad_l,
                                               s.pad_r);
      dnnl::convolution_backward_data::primitive_desc pd(bd, c.eng, hint);
      e.prim = dnnl::convolution_backward_data(pd);
      e.diff_src = memory(s.src, c.eng, DNNL_MEMORY_NONE);
      e.diff_dst = memory(s.dst, c.eng, DNNL_MEMORY_NONE);
      e.wts_user = memory(s.wts_user, c.eng, DNNL_MEMORY_NONE);
      e.reorder_w = pd.weights_desc() != s.wts_user;
      if (e.reorder_w) {
        e.wts = memory(pd.weights_desc(), c.eng);
        e.wts_reorder = dnnl::reorder(e.wts_user, e.wts);
      }
      c.impl[1] = pd.impl_info_str();
    });
    if (!e.ok) return false;
    e.diff_src.set_data_handle(dx);
    e.diff_dst.set_data_handle(const_cast<float*>(dy));
    e.wts_user.set_data_handle(const_cast<float*>(w));
    if (e.reorder_w) e.wts_reorder.execute(c.strm, e.wts_user, e.wts);
    e.prim.execute(c.strm, {{DNNL_ARG_DIFF_SRC, e.diff_src},
                            {DNNL_ARG_WEIGHTS, e.reorder_w ? e.wts : e.wts_user},
                            {DNNL_ARG_DIFF_DST, e.diff_dst}});
    c.strm.wait();
    return true;
  });
}

bool dnnl_conv_bwd_filter(ConvCache& c, const ConvDims& d, const float* x, const float* dy,
                          float* dw, float* db, bool accumulate) {
  return wrap("conv2d_bwd_filter", d, [&] {
    BwdWeightsEntry& e = entry(c.bwd_w, d, [&](BwdWeightsEntry& e) {
      Descs s = make_descs(d);
      auto hint = fwd_pd(s, c.eng);
      dnnl::convolution_backward_weights::desc bd(dnnl::algorithm::convolution_direct, s.src,
                                                  s.wts_any, s.bias, s.dst, s.strides,
                                                  s.dilates, s.pad_l, s.pad_r);
      dnnl::convolution_backward_weights::primitive_desc pd(bd, c.eng, hint);
      // oneDNN 2.6's 1x1 kernel for strided backward-weights (its "reduce to unit stride"
      // copy) computes wrong filter gradients and corrupts the heap on AVX2-only CPUs
      // (seen on an AMD EPYC: ResNet's stride-2 shortcut). Take the next implementation.
      if (d.KH == 1 && d.KW == 1 && (d.p.stride_h > 1 || d.p.stride_w > 1))
        while (std::string(pd.impl_info_str()).rfind("jit_1x1", 0) == 0)
          if (!pd.next_impl()) throw dnnl::error(dnnl_unimplemented, "no strided 1x1 kernel");
      e.prim = dnnl::convolution_backward_weights(pd);
      e.src = memory(s.src, c.eng, DNNL_MEMORY_NONE);
      e.diff_dst = memory(s.dst, c.eng, DNNL_MEMORY_NONE);
      e.diff_wts_user = memory(s.wts_user, c.eng, DNNL_MEMORY_NONE);
      e.direct = pd.diff_weights_desc() == s.wts_user;
      e.diff_wts = memory(pd.diff_weights_desc(), c.eng);  // used unless direct && !accumulate
      e.to_user = dnnl::reorder(e.diff_wts, e.diff_wts_user);
      dnnl::post_ops po;
      po.append_sum(1.f);
      dnnl::primitive_attr attr;
      attr.set_post_ops(po);
      e.to_user_sum = dnnl::reorder(
          dnnl::reorder::primitive_desc(e.diff_wts, e.diff_wts_user, attr));
      if (d.has_bias) {
        e.bias_buf.resize(size_t(d.O));
        e.diff_bias = memory(s.bias, c.eng, e.bias_buf.data());
      }
      c.impl[2] = pd.impl_info_str();
    });
    if (!e.ok) return false;
    e.src.set_data_handle(const_cast<float*>(x));
    e.diff_dst.set_data_handle(const_cast<float*>(dy));
    e.diff_wts_user.set_data_handle(dw);
    const bool into_user = e.direct && !accumulate;
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, e.src},
                                         {DNNL_ARG_DIFF_DST, e.diff_dst},
                                         {DNNL_ARG_DIFF_WEIGHTS,
                                          into_user ? e.diff_wts_user : e.diff_wts}};
    if (d.has_bias) args[DNNL_ARG_DIFF_BIAS] = e.diff_bias;
    e.prim.execute(c.strm, args);
    if (!into_user)
      (accumulate ? e.to_user_sum : e.to_user).execute(c.strm, e.diff_wts, e.diff_wts_user);
    c.strm.wait();
    if (d.has_bias && db) {
      for (int64_t o = 0; o < d.O; ++o)
        db[o] = accumulate ? db[o] + e.bias_buf[size_t(o)] : e.bias_buf[size_t(o)];
    }
    return true;
  });
}

}  // namespace dtrain::cpu
