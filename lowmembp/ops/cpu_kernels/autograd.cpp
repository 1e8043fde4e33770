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
// Nodes are built as PyTorch's generated ones are (no torch::autograd::Function: no CppNode / AutogradContext).
#include <torch/extension.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <ATen/autocast_mode.h>

#include <cstdint>
#include <string>

namespace lmbp {

using codes2_fn = int (*)(const void*, int, int64_t, float, float, float, uint8_t*, int);
using slopes2_fn = int (*)(const void*, int, const uint8_t*, int64_t, const float*, void*, int);
static codes2_fn k_codes2 = nullptr;
static slopes2_fn k_slopes2 = nullptr;
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
    py::gil_scoped_acquire gil;
    py::object dx = (*callback)(dy, packed, kind, graph);
    return dx.cast<at::Tensor>();
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

// y with the codes saved on a new node, or None where the Python route must run (see the top of the file)
static py::object approx_act(const at::Tensor& x, int64_t kind, bool native_exact) {
    TORCH_CHECK(k_codes2 && k_slopes2 && callback, "lowmembp: the C++ approx_act node is not set up");
    TORCH_CHECK(kind >= 0 && kind < N_KINDS && consts[kind].set, "lowmembp: unknown approx_act kind ", kind);
    int dt = dtype_code(x.scalar_type());
    int64_t n = x.numel();
    if (dt < 0 || !x.is_cpu() || x.layout() != at::kStrided || n < 4 || !x.requires_grad() ||
        !torch::autograd::GradMode::is_enabled() || at::autocast::is_autocast_enabled(at::kCPU)) {
        return py::none();
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
        if (dt == 0 || (native_exact && !(dt == 1 && (seen & K_TINY_BF16)))) {
            y = activation(xc, int(kind));
        } else {
            y = activation(xc.to(at::kFloat), int(kind)).to(xc.scalar_type());
        }
        p[nbytes] = 0;  // the flag byte: no NaN, no +inf
    }
    auto node = c10::make_intrusive<ApproxActBackward>();
    node->kind_ = int(kind);
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    node->packed_ = torch::autograd::SavedVariable(packed, false);
    torch::autograd::set_history(y, node);
    return py::cast(y);
}

static void set_kernels(int64_t codes2_addr, int64_t slopes2_addr) {
    k_codes2 = reinterpret_cast<codes2_fn>(codes2_addr);
    k_slopes2 = reinterpret_cast<slopes2_fn>(slopes2_addr);
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
    m.doc() = "lowmembp's C++ autograd node for ReGELU2 / ReSiLU2 on the CPU (lowmembp/ops/cpu_kernels/autograd.cpp)";
    m.def("approx_act", &lmbp::approx_act, "y with the 2-bit codes saved on a C++ node, or None (the Python route)");
    m.def("set_kernels", &lmbp::set_kernels, "addresses of kernels.c's lmbp_codes2 and lmbp_slopes2");
    m.def("set_constants", &lmbp::set_constants, "a kind's fp32 thresholds (3) and slopes (4)");
    m.def("set_callback", &lmbp::set_callback, "fn(dy, packed, kind, graph) -> dx: the Python route's backward");
}
