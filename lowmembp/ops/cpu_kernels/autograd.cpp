// The approximate activations' eager CPU route as a hand-written C++ autograd Node (ReGELU2 / ReSiLU2, 2-bit codes).
//
// Built and loaded by lowmembp.ops.cpu_kernels.autograd_ext (compiled on first use, cached; a pybind module without
// TORCH_LIBRARY, so that loading it twice registers nothing twice). It computes what the Python route
// (lowmembp.ops.approx_act_cpu._fwd_cpu / _bwd_cpu) computes, bit for bit, and declines (returns None) wherever
// that route would take another path, so that the caller runs the Python route instead:
//   forward  y: fp32 at::gelu / at::silu (the reference's fp32 formula); fp16 / bf16 the native kernel where the
//            caller says it is exact for the dtype (approx_act_cpu.native_act_exact) and the input holds no tiny
//            bf16 value, else the fp32 formula rounded once; codes and checks by kernels.c's lmbp_codes2 (its
//            addresses handed over by set_kernels); any NaN / inf input, fewer than 4 elements, autocast: None.
//   saved    the packed codes + flag byte (0), n/4 + 1 bytes, as one SavedVariable (saved_tensors_hooks see it).
//   backward dx = s[code] * dy by kernels.c's lmbp_slopes2; with create_graph, a NaN product in fp16 / bf16, or
//            saved bytes that are not what the forward saved, the Python callback (set_callback) computes it
//            exactly as the Python route does (the custom op lowmembp::approx_act_bwd for a double backward).
// MS-LayerNorm / MS-RMSNorm (lowmembp.ops.ms_norm_cpu's route, bit for bit; None where that route would take
// another path than the ones below):
//   forward  LayerNorm whole in kernels.c's lmbp_layer_norm_fwd where the probe found ATen's variant; else (and for
//            RMSNorm) the reference's own ATen calls where the Python route makes them (fp32 in and out, or fewer
//            than `small` elements); larger tensors of other dtypes, strided or too wide rows, empty inputs, a NaN
//            in the result, autocast: None.
//   saved    y itself (the very tensor returned, which the next linear saves too) and rstd, as SavedVariables.
//   backward lmbp_norm_bwd_rows where ATen's summation order and addcmul rounding were found (the probes), else,
//            for a NaN in dx, create_graph or inputs the C pass does not take, the Python callback (the route's own
//            backward, whose custom op refuses a double backward).
// Nodes are built as PyTorch's generated ones are (no torch::autograd::Function: no CppNode / AutogradContext); older
// torch (2.8) holds them in std::shared_ptr, newer in c10::intrusive_ptr (make_node picks by Edge::function's type).
#include <torch/extension.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/Exceptions.h>
#include <ATen/autocast_mode.h>
#include <torch/version.h>

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 9)
#define LMBP_FUSED_RMS 1  // at::_fused_rms_norm(x, normalized_shape, weight, eps) with a CPU kernel (torch >= 2.9)
#else
#define LMBP_FUSED_RMS 0
#endif

namespace lmbp {

using NodePtr = decltype(torch::autograd::Edge::function);

template <typename T>
static auto make_node() {  // a new node held as this torch holds nodes
    if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
        return std::make_shared<T>();
    } else {
        return c10::make_intrusive<T>();
    }
}

using codes2_fn = int (*)(const void*, int, int64_t, float, float, float, uint8_t*, int);
using slopes2_fn = int (*)(const void*, int, const uint8_t*, int64_t, const float*, void*, int);
using check_fn = int (*)(const void*, int, int64_t, int);
static codes2_fn k_codes2 = nullptr;
static slopes2_fn k_slopes2 = nullptr;
static check_fn k_check = nullptr;
enum : int { K_NONFINITE = 1, K_TINY_BF16 = 2 };  // lmbp_codes2's return bits (cpu_kernels.NONFINITE / TINY_BF16)
constexpr int64_t MIN_PER_THREAD = int64_t(1) << 16;  // cpu_kernels.MIN_PER_THREAD

enum Kind : int { GELU = 0, SILU = 1, N_KINDS = 2 };
struct Consts {
    float t[3];
    float s[4];
    bool set = false;
};
static Consts consts[N_KINDS];
// the Python route's backward, called (GIL taken) where this node does not compute dx itself; never freed (a
// py::object destroyed after the interpreter has finalised would crash at exit)
static py::object* callback = nullptr;

// Python exceptions keep their type across this module's C++. A saved-tensor hook that raises (checkpointing's early
// stop, say) throws torch's python_error inside SavedVariable; pybind11 knows that type only where it shares torch's
// internals (not with every compiler), so the bound functions turn it back into the Python exception
// (keep_python_error); a Python callback's exception goes to the autograd engine as python_error, which it re-raises.
template <typename F>
static auto keep_python_error(F&& f) {
    try {
        return f();
    } catch (python_error& e) {
        e.persist();
        e.restore();
        throw py::error_already_set();
    }
}

template <typename... Args>
static at::Tensor call_python(const py::object& fn, Args&&... args) {
    py::gil_scoped_acquire gil;
    try {
        return fn(std::forward<Args>(args)...).template cast<at::Tensor>();
    } catch (py::error_already_set& e) {
        e.restore();
        python_error err;
        err.persist();
        throw err;
    }
}

static int dtype_code(at::ScalarType st) {  // cpu_kernels.build._DTYPES; -1: not one of them
    return st == at::kFloat ? 0 : st == at::kBFloat16 ? 1 : st == at::kHalf ? 2 : -1;
}

static int threads_for(int64_t n) {  // cpu_kernels.build._threads
    if (n < 2 * MIN_PER_THREAD) return 1;
    return int(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / MIN_PER_THREAD)));
}

static at::Tensor activation(const at::Tensor& x, int kind) {
    return kind == GELU ? at::gelu(x) : at::silu(x);
}

static at::Tensor run_callback(const at::Tensor& dy, const at::Tensor& packed, int kind, bool graph) {
    TORCH_CHECK(callback != nullptr, "lowmembp: the C++ approx_act node has no Python callback");
    return call_python(*callback, dy, packed, kind, graph);
}

struct ApproxActBackward : public torch::autograd::Node {
    torch::autograd::SavedVariable packed_;
    int kind_ = GELU;

    std::string name() const override { return "lowmembp::ApproxActBackward"; }

    torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
        at::Tensor dy = grads[0];
        if (!dy.defined()) dy = input_metadata(0).zeros_like();  // as a Python Function materialises it
        at::Tensor packed = packed_.unpack();
        if (torch::autograd::GradMode::is_enabled()) return {run_callback(dy, packed, kind_, true)};
        int64_t n = dy.numel();
        int64_t nbytes = (n + 3) / 4;
        int dt = dtype_code(dy.scalar_type());
        if (dt < 0 || !dy.is_cpu() || dy.layout() != at::kStrided || n < 4 || !packed.is_cpu() ||
            packed.scalar_type() != at::kByte || !packed.is_contiguous() || packed.numel() != nbytes + 1 ||
            packed.const_data_ptr<uint8_t>()[nbytes] != 0) {
            return {run_callback(dy, packed, kind_, false)};  // not what the forward saved (a hook replaced it)
        }
        at::Tensor dyc = dy.contiguous();
        at::Tensor dx = at::empty_like(dyc);
        int nan = k_slopes2(dyc.const_data_ptr(), dt, packed.const_data_ptr<uint8_t>(), n, consts[kind_].s,
                            dx.data_ptr(), threads_for(n));
        if (nan && dt != 0) return {run_callback(dy, packed, kind_, false)};  // NaN bits by ATen's rounding
        return {dx};
    }

    void release_variables() override { packed_.reset_data(); }
};

// y (exact for the dtype: see the top of the file) of contiguous xc, whose kernels.c bits are `seen`
static at::Tensor exact_activation(const at::Tensor& xc, int kind, int dt, bool native_exact, int seen) {
    if (dt == 0 || (native_exact && !(dt == 1 && (seen & K_TINY_BF16)))) return activation(xc, kind);
    return activation(xc.to(at::kFloat), kind).to(xc.scalar_type());
}

// y with the codes saved on a new node; y alone where no gradient is recorded (the Python route's forward without
// codes: kernels.c's lmbp_check, then the activation); None where the Python route must run (the top of the file)
static py::object approx_act(const at::Tensor& x, int64_t kind, bool native_exact) {
    TORCH_CHECK(k_codes2 && k_slopes2 && k_check && callback, "lowmembp: the C++ approx_act node is not set up");
    TORCH_CHECK(kind >= 0 && kind < N_KINDS && consts[kind].set, "lowmembp: unknown approx_act kind ", kind);
    int dt = dtype_code(x.scalar_type());
    int64_t n = x.numel();
    bool grad = x.requires_grad() && torch::autograd::GradMode::is_enabled();
    if (dt < 0 || !x.is_cpu() || x.layout() != at::kStrided || n < (grad ? 4 : 1) ||
        at::autocast::is_autocast_enabled(at::kCPU)) {
        return py::none();
    }
    if (!grad) {
        at::Tensor xc = x.contiguous();
        int seen = k_check(xc.const_data_ptr(), dt, n, threads_for(n));
        if (seen & K_NONFINITE) return py::none();  // the reference's output: the Python route
        return py::cast(exact_activation(xc, int(kind), dt, native_exact, seen));
    }
    const Consts& c = consts[kind];
    at::Tensor y, packed;
    {
        at::AutoDispatchBelowADInplaceOrView guard;  // the kernels' own at:: calls record no autograd
        at::Tensor xc = x.contiguous();
        int64_t nbytes = (n + 3) / 4;
        packed = at::empty({nbytes + 1}, xc.options().dtype(at::kByte));
        uint8_t* p = packed.data_ptr<uint8_t>();
        int seen = k_codes2(xc.const_data_ptr(), dt, n, c.t[0], c.t[1], c.t[2], p, threads_for(n));
        if (seen & K_NONFINITE) return py::none();  // the reference's output and flag byte: the Python route
        y = exact_activation(xc, int(kind), dt, native_exact, seen);
        p[nbytes] = 0;  // the flag byte: no NaN, no +inf
    }
    auto node = make_node<ApproxActBackward>();
    node->kind_ = int(kind);
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    node->packed_ = torch::autograd::SavedVariable(packed, false);
    torch::autograd::set_history(y, node);
    return py::cast(y);
}

// ------------------------------------------------------------------------------------ MS-LayerNorm / MS-RMSNorm
using ln_fwd_fn = int (*)(const void*, int, int64_t, int64_t, float, void*, int, float*, int, int, int);
using norm_bwd_rows_fn = int (*)(const void*, int, const void*, int, int64_t, int64_t, const float*, void*, int, int,
                                 int, int, int);
static ln_fwd_fn k_ln_fwd = nullptr;
static norm_bwd_rows_fn k_norm_bwd_rows = nullptr;
enum NormKind : int { LAYERNORM = 0, RMSNORM = 1 };
struct NormConfig {  // set once by lowmembp.ops.ms_norm_cpu (its limits, and what the probes found for this torch)
    int ln_width = -1, ln_flags = 0;  // cpu_kernels.layer_norm_variant(); width -1: none (ATen's own calls)
    int sum_width = -1, fused = -1;   // cpu_kernels.aten_sum_width() / addcmul_fused(); -1: none (the callback)
    bool rms_fused = false;           // _compat's fused_rms_norm takes torch's fused kernel
    int64_t max_n = 0, small = 0, grain = 0;  // ms_norm_cpu._CPU_MAX_N, _SMALL, _ATEN_GRAIN
    bool set = false;
};
static NormConfig norm_cfg;
static py::object* norm_callback = nullptr;  // fn(g, y, rstd, kind, dx_dtype, graph) -> dx; never freed (see above)
static const at::ScalarType DTYPES[3] = {at::kFloat, at::kBFloat16, at::kHalf};

static at::Tensor run_norm_callback(const at::Tensor& g, const at::Tensor& y, const at::Tensor& rstd, int kind,
                                    int dx_dt, bool graph) {
    TORCH_CHECK(norm_callback != nullptr, "lowmembp: the C++ ms_norm node has no Python callback");
    return call_python(*norm_callback, g, y, rstd, kind, dx_dt, graph);
}

struct MSNormBackward : public torch::autograd::Node {
    torch::autograd::SavedVariable y_, rstd_;
    int kind_ = LAYERNORM, dx_dt_ = 0;

    std::string name() const override { return "lowmembp::MSNormBackward"; }

    torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
        at::Tensor g = grads[0];
        if (!g.defined()) g = input_metadata(0).zeros_like();  // as a Python Function materialises it
        at::Tensor y = y_.unpack(getptr());
        at::Tensor rstd = rstd_.unpack();
        if (torch::autograd::GradMode::is_enabled()) return {run_norm_callback(g, y, rstd, kind_, dx_dt_, true)};
        int64_t n = y.dim() ? y.size(-1) : 0;
        int gd = dtype_code(g.scalar_type()), yd = dtype_code(y.scalar_type());
        // what ms_norm_bwd_cpu hands to lmbp_norm_bwd_rows; anything else (a hook that changed the saved tensors,
        // a strided g, a probe that found no replica) takes the callback, which runs that function itself
        if (norm_cfg.sum_width < 0 || norm_cfg.fused < 0 || gd < 0 || yd < 0 || n == 0 || n > norm_cfg.max_n ||
            !g.is_cpu() || !y.is_cpu() || !rstd.is_cpu() || g.layout() != at::kStrided ||
            y.layout() != at::kStrided || !g.is_contiguous() || !y.is_contiguous() || !rstd.is_contiguous() ||
            rstd.scalar_type() != at::kFloat || g.sizes() != y.sizes() || rstd.numel() * n != y.numel()) {
            return {run_norm_callback(g, y, rstd, kind_, dx_dt_, false)};
        }
        int64_t rows = y.numel() / n;
        if (rows == 1 && n >= norm_cfg.grain) return {run_norm_callback(g, y, rstd, kind_, dx_dt_, false)};
        at::Tensor dx = at::empty_like(y, y.options().dtype(DTYPES[dx_dt_]));
        int team = int(std::min<int64_t>(threads_for(rows * n), rows));
        int bits = k_norm_bwd_rows(g.const_data_ptr(), gd, y.const_data_ptr(), yd, rows, n,
                                   rstd.const_data_ptr<float>(), dx.data_ptr(), dx_dt_, kind_ == LAYERNORM,
                                   norm_cfg.fused, norm_cfg.sum_width, std::max(1, team));
        if (bits != 0) return {run_norm_callback(g, y, rstd, kind_, dx_dt_, false)};  // a NaN (its bits: ATen's)
        return {dx};
    }

    void release_variables() override {
        y_.reset_data();
        rstd_.reset_data();
    }
};

// the reference's ATen calls (ms_norm_reference.ms_norm_fwd_ref on a non-empty input): (y, rstd [rows])
static std::pair<at::Tensor, at::Tensor> norm_reference(const at::Tensor& x, int kind, double eps,
                                                        at::ScalarType out) {
    int64_t n = x.size(-1), rows = x.numel() / n;
    at::Tensor xf = x.to(at::kFloat);
    at::Tensor y, rstd;
    if (kind == LAYERNORM) {
        auto res = at::native_layer_norm(xf, {n}, std::nullopt, std::nullopt, eps);
        y = std::get<0>(res);
        rstd = std::get<2>(res);
    } else if (norm_cfg.rms_fused) {  // _compat.fused_rms_norm: torch's fused kernel (compiled in: see the caller)
#if LMBP_FUSED_RMS
        auto res = at::_fused_rms_norm(xf, {n}, std::nullopt, eps);
        y = std::get<0>(res);
        rstd = std::get<1>(res);
#endif
    } else {  // _compat.fused_rms_norm's plain ops
        rstd = at::rsqrt(xf.square().mean(-1, true) + eps);
        y = xf * rstd;
    }
    return {y.to(out), rstd.reshape({rows})};
}

// y with y and rstd saved on a new node (y alone where no gradient is recorded), or None where the Python route must
// run (see the top of the file)
static py::object ms_norm(const at::Tensor& x, int64_t kind, double eps, int64_t out_dt) {
    TORCH_CHECK(norm_cfg.set && norm_callback && k_ln_fwd && k_norm_bwd_rows, "lowmembp: the C++ ms_norm node is "
                "not set up");
    TORCH_CHECK((kind == LAYERNORM || kind == RMSNORM) && out_dt >= 0 && out_dt < 3, "lowmembp: bad ms_norm call");
    int xd = dtype_code(x.scalar_type());
    int64_t numel = x.numel();
    if (xd < 0 || !x.is_cpu() || x.layout() != at::kStrided || x.dim() == 0 || numel == 0 || !x.is_contiguous() ||
        at::autocast::is_autocast_enabled(at::kCPU)) {
        return py::none();
    }
    int64_t n = x.size(-1), rows = numel / n;
    if (n > norm_cfg.max_n) return py::none();
    at::ScalarType out = DTYPES[out_dt];
    at::Tensor y, rstd;
    {
        at::AutoDispatchBelowADInplaceOrView guard;  // the forward's own at:: calls record no autograd
        if (kind == LAYERNORM && norm_cfg.ln_width > 0) {  // ms_norm_fwd_cpu: whole in C
            y = at::empty_like(x, x.options().dtype(out));
            rstd = at::empty({rows}, x.options().dtype(at::kFloat));
            int team = int(std::min<int64_t>(threads_for(numel), rows));
            int bits = k_ln_fwd(x.const_data_ptr(), xd, rows, n, float(eps), y.data_ptr(), int(out_dt),
                                rstd.data_ptr<float>(), norm_cfg.ln_width, norm_cfg.ln_flags, std::max(1, team));
            if (bits != 0) return py::none();  // a NaN: the reference's bits (the Python route)
        } else if ((xd == 0 && out_dt == 0) || numel < norm_cfg.small) {  // ms_norm_fwd_cpu: the reference's calls
            if (kind == RMSNORM && norm_cfg.rms_fused && !LMBP_FUSED_RMS) return py::none();
            std::tie(y, rstd) = norm_reference(x, int(kind), eps, out);
        } else {
            return py::none();  // the C casts around ATen's norm, over row blocks: the Python route
        }
    }
    if (!(x.requires_grad() && torch::autograd::GradMode::is_enabled())) return py::cast(y);  // no gradient recorded
    auto node = make_node<MSNormBackward>();
    node->kind_ = int(kind);
    node->dx_dt_ = xd;
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    torch::autograd::set_history(y, node);
    node->y_ = torch::autograd::SavedVariable(y, true);  // the output itself, saved as generated nodes save one
    node->rstd_ = torch::autograd::SavedVariable(rstd, false);  // after y: the order the Python route saves them
    return py::cast(y);
}

static void set_norm_kernels(int64_t ln_fwd_addr, int64_t bwd_rows_addr) {
    k_ln_fwd = reinterpret_cast<ln_fwd_fn>(ln_fwd_addr);
    k_norm_bwd_rows = reinterpret_cast<norm_bwd_rows_fn>(bwd_rows_addr);
}

static void set_norm_config(int64_t ln_width, int64_t ln_flags, int64_t sum_width, int64_t fused, bool rms_fused,
                            int64_t max_n, int64_t small, int64_t grain) {
    norm_cfg.ln_width = int(ln_width);
    norm_cfg.ln_flags = int(ln_flags);
    norm_cfg.sum_width = int(sum_width);
    norm_cfg.fused = int(fused);
    norm_cfg.rms_fused = rms_fused;
    norm_cfg.max_n = max_n;
    norm_cfg.small = small;
    norm_cfg.grain = grain;
    norm_cfg.set = true;
}

static void set_norm_callback(py::object fn) {
    if (norm_callback == nullptr) norm_callback = new py::object();
    *norm_callback = std::move(fn);
}

static void set_kernels(int64_t codes2_addr, int64_t slopes2_addr, int64_t check_addr) {
    k_codes2 = reinterpret_cast<codes2_fn>(codes2_addr);
    k_slopes2 = reinterpret_cast<slopes2_fn>(slopes2_addr);
    k_check = reinterpret_cast<check_fn>(check_addr);
}

static void set_constants(int64_t kind, std::vector<double> t, std::vector<double> s) {
    TORCH_CHECK(kind >= 0 && kind < N_KINDS && t.size() == 3 && s.size() == 4, "lowmembp: bad approx_act constants");
    for (int i = 0; i < 3; i++) consts[kind].t[i] = float(t[i]);  // fp32 values already: exact
    for (int i = 0; i < 4; i++) consts[kind].s[i] = float(s[i]);
    consts[kind].set = true;
}

static void set_callback(py::object fn) {
    if (callback == nullptr) callback = new py::object();
    *callback = std::move(fn);
}

}  // namespace lmbp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "lowmembp's C++ autograd nodes for ReGELU2 / ReSiLU2 and the MS-norms on the CPU (lowmembp/ops/cpu_kernels/autograd.cpp)";
    m.def("approx_act", [](const at::Tensor& x, int64_t kind, bool native_exact) {
        return lmbp::keep_python_error([&] { return lmbp::approx_act(x, kind, native_exact); });
    }, "y (with grad: its 2-bit codes saved on a C++ node), or None (the Python route)");
    m.def("set_kernels", &lmbp::set_kernels, "addresses of kernels.c's lmbp_codes2, lmbp_slopes2 and lmbp_check");
    m.def("set_constants", &lmbp::set_constants, "a kind's fp32 thresholds (3) and slopes (4)");
    m.def("set_callback", &lmbp::set_callback, "fn(dy, packed, kind, graph) -> dx: the Python route's backward");
    m.def("ms_norm", [](const at::Tensor& x, int64_t kind, double eps, int64_t out_dt) {
        return lmbp::keep_python_error([&] { return lmbp::ms_norm(x, kind, eps, out_dt); });
    }, "y (with grad: y and rstd saved on a C++ node), or None (the Python route)");
    m.def("set_norm_kernels", &lmbp::set_norm_kernels, "addresses of lmbp_layer_norm_fwd and lmbp_norm_bwd_rows");
    m.def("set_norm_config", &lmbp::set_norm_config, "the norms' limits and what the probes found");
    m.def("set_norm_callback", &lmbp::set_norm_callback, "fn(g, y, rstd, kind, dx_dtype, graph) -> dx");
    m.attr("fused_rms_norm") = bool(LMBP_FUSED_RMS);
}
