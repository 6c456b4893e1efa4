// The C API's argument checking, fuzzed (issue 38): every entry point of fastaxial.h against an
// independent model of the rules it documents, over seeded random arguments (bounded, a few
// seconds even under the sanitizers) and explicit edge cases. Sizes negative, zero, huge and
// overflowing int64 or size_t; heads <= 0 or not dividing dim; eps < 0, NaN, inf; dropout outside
// [0, 1]; each pointer null; out aliasing x; buffers 4-byte but not 16-byte aligned.
//
// Each call must return what the rules say (an error for bad arguments, never a crash), leave
// its outputs alone when it fails, and never write outside them when it runs: every buffer has
// guard zones of a sentinel on both sides, inside its allocation (where AddressSanitizer cannot
// see), and each plan that a planning function returns must hold its own regions (checked in
// exact 128-bit arithmetic, so that a size that wrapped around shows). scripts/sanitize runs this
// suite under AddressSanitizer and UBSan, which see what the guards cannot: reads out of bounds,
// signed overflow in the library's own size arithmetic.
//
// FASTAXIAL_FUZZ_SEED and FASTAXIAL_FUZZ_CASES override the seed and the count of random cases
// (for a longer run by hand); a failure names the seed, the case and its arguments.
#include "common/api_fuzz_model.h"

namespace fastaxial::test {
namespace {

// ---- the random cases ------------------------------------------------------------------------

TEST(ApiFuzz, EveryEntryPointFollowsTheRules) {
  const uint64_t seed = env_or("FASTAXIAL_FUZZ_SEED", 38), cases = env_or("FASTAXIAL_FUZZ_CASES", 4000);
  std::mt19937_64 rng(seed);
  int ran = 0, refused = 0;
  for (int sig : {SIGABRT, SIGSEGV, SIGFPE, SIGBUS, SIGILL}) std::signal(sig, on_fatal_signal);
#ifdef FASTAXIAL_SANITIZED
  __sanitizer_set_death_callback(print_current);
  // GCC links UBSan as a library of its own, with its own copy of the callback.
  if (void* ubsan = dlopen("libubsan.so.1", RTLD_NOW | RTLD_NOLOAD))
    if (auto set = reinterpret_cast<void (*)(void (*)())>(dlsym(ubsan, "__sanitizer_set_death_callback")))
      set(print_current);
#endif
  for (uint64_t i = 0; i < cases; ++i) {
    const Case c = random_case(rng);
    g_current = "FASTAXIAL_FUZZ_SEED=" + std::to_string(seed) + ", case " + std::to_string(i) + ": " + c.describe();
    SCOPED_TRACE(g_current);
    const Outcome o = check_case(c, rng);
    ran += o.ran, refused += o.refused;
    if (HasFailure()) break;  // the first failing case is the one to read
  }
  // The generator must reach both sides of the rules in numbers.
  if (HasFailure()) return;
  EXPECT_GT(ran, static_cast<int>(cases / 10)) << "too few cases ran the CPU kernels";
  EXPECT_GT(refused, static_cast<int>(cases / 5)) << "too few cases were refused";
  std::printf("%llu cases (seed %llu): %d ran the CPU forward or backward, %d refused by validate()\n",
              static_cast<unsigned long long>(cases), static_cast<unsigned long long>(seed), ran, refused);
}

// ---- explicit edge cases ---------------------------------------------------------------------

// A valid small problem with real buffers.
struct Small {
  Case c;
  std::mt19937_64 rng{5};
  Small(int64_t B = 1, int64_t H = 3, int64_t W = 4, int64_t D = 8, int64_t heads = 2, size_t shift = 0) {
    c.p.batch = B, c.p.height = H, c.p.width = W, c.p.dim = D, c.p.heads = heads;
    c.shift = shift;
    std::fill(c.want, c.want + 10, true);
  }
};

TEST(ApiFuzz, EachNullTensorIsRefusedByName) {
  static const char* names[12] = {"x", "out", "row.norm_weight", "row.norm_bias", "row.qkv_weight",
                                  "row.out_weight", "row.out_bias", "col.norm_weight", "col.norm_bias",
                                  "col.qkv_weight", "col.out_weight", "col.out_bias"};
  for (int i = 0; i < 12; ++i) {
    SCOPED_TRACE(names[i]);
    Small s;
    s.c.null_ptr[i] = true;
    Tensors t(s.c, s.rng);
    const AxialParams p = t.params(s.c);
    const Status v = validate(p);
    EXPECT_EQ(v.code, StatusCode::kInvalidArgument);
    EXPECT_NE(v.message.find(names[i]), std::string::npos) << v.message;
    EXPECT_EQ(forward_cpu(p).code, StatusCode::kInvalidArgument);
    // The backward does not read out.
    EXPECT_EQ(backward_cpu(p, t.grads(s.c, p)).code, i == 1 ? StatusCode::kOk : StatusCode::kInvalidArgument);
    if (i != 1) {
      EXPECT_TRUE(t.untouched());
    }
    check_case(s.c, s.rng);
  }
  Small s;
  s.c.null_grad_out = true;
  Tensors t(s.c, s.rng);
  const AxialParams p = t.params(s.c);
  const Status b = backward_cpu(p, t.grads(s.c, p));
  EXPECT_EQ(b.code, StatusCode::kInvalidArgument);
  EXPECT_NE(b.message.find("grad_out"), std::string::npos) << b.message;
  EXPECT_TRUE(t.untouched());
}

TEST(ApiFuzz, AliasesAreRefusedOrAllowedAsDocumented) {
  Small s;
  s.c.out_is_x = true;
  {
    Tensors t(s.c, s.rng);
    EXPECT_EQ(forward_cpu(t.params(s.c)).code, StatusCode::kInvalidArgument);
    EXPECT_TRUE(t.untouched());
  }
  s.c.out_is_x = false;
  s.c.grad_x_is_x = true;
  {
    Tensors t(s.c, s.rng);
    const AxialParams p = t.params(s.c);
    EXPECT_EQ(backward_cpu(p, t.grads(s.c, p)).code, StatusCode::kInvalidArgument);
    EXPECT_TRUE(t.untouched());
  }
  s.c.grad_x_is_x = false;
  s.c.grad_x_is_grad_out = true;  // allowed: grad_out overwritten in place
  EXPECT_TRUE(check_case(s.c, s.rng).ran);
}

TEST(ApiFuzz, BadSizesHeadsEpsAndDropoutAreRefused) {
  struct Bad {
    int64_t B, H, W, D, heads;
    float eps, dropout;
    const char* why;
  };
  const float k = 1e-5f;
  const Bad bad[] = {
      {-1, 3, 4, 8, 2, k, 0, "batch < 0"},
      {1, -1, 4, 8, 2, k, 0, "height < 0"},
      {1, 3, kI64Min, 8, 2, k, 0, "width = INT64_MIN"},
      {1, 3, 4, 0, 1, k, 0, "dim = 0"},
      {1, 3, 4, -8, 2, k, 0, "dim < 0"},
      {1, 3, 4, 8, 0, k, 0, "heads = 0"},
      {1, 3, 4, 8, -2, k, 0, "heads < 0"},
      {1, 3, 4, 8, kI64Min, k, 0, "heads = INT64_MIN"},
      {1, 3, 4, 8, 3, k, 0, "heads not dividing dim"},
      {1, 3, 4, 8, 16, k, 0, "heads > dim"},
      {1, 3, 4, kI64Max, kI64Max - 1, k, 0, "heads not dividing a huge dim"},
      {1, 3, 4, 8, 2, -1e-5f, 0, "eps < 0"},
      {1, 3, 4, 8, 2, kNaN, 0, "eps NaN"},
      {1, 3, 4, 8, 2, -kInf, 0, "eps -inf"},
      {1, 3, 4, 8, 2, k, -1e-7f, "dropout < 0"},
      {1, 3, 4, 8, 2, k, 1.0000001f, "dropout > 1"},
      {1, 3, 4, 8, 2, k, kNaN, "dropout NaN"},
      {1, 3, 4, 8, 2, k, kInf, "dropout inf"},
      {1, 3, 4, 8, 2, k, -kInf, "dropout -inf"},
      {int64_t{1} << 20, int64_t{1} << 20, int64_t{1} << 20, 8, 2, k, 0, "B*H*W*D = 2^63"},
      {kI64Max, kI64Max, kI64Max, kI64Max, 1, k, 0, "every size INT64_MAX"},
      {int64_t{1} << 32, int64_t{1} << 32, 1, 1, 1, k, 0, "B*H*W*D = 2^64, 0 in int64"},
      {(int64_t{1} << 32) + 1, (int64_t{1} << 32) - 1, 1, 1, 1, k, 0, "B*H*W*D = 2^64 - 1, -1 in int64"},
      {0, int64_t{1} << 40, int64_t{1} << 40, 1, 1, k, 0, "B = 0, H*W = 2^80"},
      {1, 1, int64_t{1} << 32, 1, 1, k, 0.5f, "the dropout mask's count, B H W^2 = 2^64"},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.why);
    Small s(b.B, b.H, b.W, b.D, b.heads);
    s.c.p.eps = b.eps, s.c.p.dropout = b.dropout;
    const bool unsupported = b.dropout > 0.0f && b.dropout <= 1.0f && !dropout_compiled();
    const StatusCode want = unsupported ? StatusCode::kUnsupported : StatusCode::kInvalidArgument;
    Tensors t(s.c, s.rng);
    EXPECT_EQ(validate(t.params(s.c)).code, want);
    EXPECT_TRUE(sizes_rule(s.c.p) & bit(want)) << "the model";
    check_case(s.c, s.rng);
  }
}

TEST(ApiFuzz, EdgesThatAreValid) {
  // eps = 0, eps = +inf (accepted: LayerNorm's output is then its shift, and the output finite),
  // dropout = 0 and 1, heads = dim, one position, B*H*W*D = INT64_MAX exactly (no memory for it:
  // validate and the planners only).
  for (float eps : {0.0f, kInf, std::numeric_limits<float>::max()}) {
    Small s;
    s.c.p.eps = eps;
    Tensors t(s.c, s.rng);
    const AxialParams p = t.params(s.c);
    ASSERT_TRUE(forward_cpu(p).ok()) << eps;
    EXPECT_TRUE(t.out->all_finite()) << "eps " << eps;
    EXPECT_TRUE(check_case(s.c, s.rng).ran);
  }
  for (float dropout : {0.0f, 1.0f}) {
    Small s;
    s.c.p.dropout = dropout;
    EXPECT_EQ(check_case(s.c, s.rng).ran, dropout == 0.0f || dropout_compiled());
  }
  for (Small s : {Small(1, 1, 1, 8, 8), Small(1, 1, 1, 1, 1), Small(2, 1, 7, 3, 3)}) {
    EXPECT_TRUE(check_case(s.c, s.rng).ran);
  }
  Small s(1, 1, 1, kI64Max, 1);
  s.c.null_ptr[0] = true;  // and no x: refused by name, not read
  EXPECT_EQ(validate(Tensors(s.c, s.rng).params(s.c)).code, StatusCode::kInvalidArgument);
  check_case(s.c, s.rng);
}

TEST(ApiFuzz, EmptyProblemsNeedNoPointersAndZeroTheWeightGradients) {
  for (Small s : {Small(0, 3, 4, 8, 2), Small(1, 0, 4, 8, 2), Small(1, 3, 0, 8, 2)}) {
    std::fill(s.c.null_ptr, s.c.null_ptr + 12, true);
    EXPECT_TRUE(validate(AxialParams(s.c.p)).ok());
    check_case(s.c, s.rng);  // the gradients it wants: zeros, and nothing around them written
  }
}

TEST(ApiFuzz, BuffersAlignedTo4BytesOnlyGiveTheAlignedResults) {
  std::vector<float> ref_out, ref_gx;
  for (size_t shift : {0, 1, 2, 3}) {
    SCOPED_TRACE(4 * shift);
    Small s(2, 5, 6, 12, 3, shift);
    std::mt19937_64 rng(9);  // the same values at every shift
    Tensors t(s.c, rng);
    const AxialParams p = t.params(s.c);
    ASSERT_EQ(reinterpret_cast<uintptr_t>(p.x) % 16, 4 * shift);
    ASSERT_TRUE(forward_cpu(p).ok());
    const AxialGrads g = t.grads(s.c, p);
    ASSERT_TRUE(backward_cpu(p, g).ok());
    EXPECT_TRUE(t.guards_intact());
    const std::vector<float> out(p.out, p.out + t.out->size()), gx(g.grad_x, g.grad_x + t.grad_x->size());
    if (shift == 0) {
      ref_out = out, ref_gx = gx;
      continue;
    }
    // Eigen's reductions may start their vector loads elsewhere: the same values to rounding.
    for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], ref_out[i], 1e-5f * (1 + std::fabs(ref_out[i])));
    for (size_t i = 0; i < gx.size(); ++i) EXPECT_NEAR(gx[i], ref_gx[i], 1e-5f * (1 + std::fabs(ref_gx[i])));
  }
  // The planners: 16-byte misaligned tensors take the generic kernels, in a sound layout.
  Small s(2, 32, 32, 64, 4, 1);
  Tensors t(s.c, s.rng);
  const AxialParams p = t.params(s.c);
  for (const DeviceCaps& dev : devices()) {
    CudaPlan plan;
    ASSERT_TRUE(make_plan(p, dev, {}, &plan).ok());
    EXPECT_EQ(plan.row.family, KernelFamily::kGeneric) << plan.describe();
    EXPECT_TRUE(sound_plan(plan, p));
  }
}

TEST(ApiFuzz, DropoutMaskRefusesABadPassAndANullOutput) {
  for (int pass : {-1, 2, std::numeric_limits<int>::min(), std::numeric_limits<int>::max()}) {
    Small s;
    s.c.mask_pass = pass;
    Tensors t(s.c, s.rng);
    EXPECT_EQ(dropout_mask(t.params(s.c), pass, t.mask->data()).code, StatusCode::kInvalidArgument) << pass;
    EXPECT_TRUE(t.untouched());
  }
  Small s;
  EXPECT_EQ(dropout_mask(s.c.p, 0, nullptr).code, StatusCode::kInvalidArgument);
  s.c.p.width = 0;
  EXPECT_TRUE(dropout_mask(s.c.p, 0, nullptr).ok()) << "nothing to write";
}

TEST(ApiFuzz, WithoutCudaEveryCudaCallSaysSo) {
  if (cuda_compiled()) GTEST_SKIP() << "this build has the CUDA kernels";
  Small s;
  Tensors t(s.c, s.rng);
  const AxialParams p = t.params(s.c);
  CudaPlan plan;
  CudaBackwardPlan bplan;
  size_t bytes = 0;
  alignas(256) static char ws[256];
  for (const Status& st : {plan_cuda(p, &plan), cuda_workspace_bytes(p, &bytes), plan_backward_cuda(p, &bplan),
                           forward_cuda(p, plan, ws, sizeof ws, nullptr), forward_cuda(p, ws, sizeof ws, nullptr),
                           forward_cuda_training(p, bplan, ws, sizeof ws, ws, sizeof ws, nullptr),
                           backward_cuda(p, t.grads(s.c, p), bplan, ws, sizeof ws, ws, sizeof ws, nullptr)}) {
    EXPECT_EQ(st.code, StatusCode::kUnsupported);
    EXPECT_NE(st.message.find("without CUDA"), std::string::npos) << st.message;
  }
  EXPECT_TRUE(t.untouched());
  // The saved size is host code: it answers without CUDA.
  ASSERT_TRUE(cuda_saved_bytes(p, &bytes).ok());
  EXPECT_GT(bytes, 0u);
}

// ---- what the fuzzing found (issue 38), each as its smallest case -------------------------------

// backward_cpu with a pass that wants its output weight's gradient but nothing through its QKV
// (grad_x null, the row pass's out_weight gradient alone) made Eigen blocks of dqkv, which it had
// not sized: an assertion in a build with Eigen's checks (the sanitizer build), an out-of-range
// pointer in others.
TEST(ApiFuzzFound, BackwardWithTheOutputWeightGradientAlone) {
  Small s(1, 4, 4, 8, 2);
  s.c.grad_x_null = true;
  std::fill(s.c.want, s.c.want + 10, false);
  s.c.want[3] = true;  // row.out_weight
  EXPECT_TRUE(check_case(s.c, s.rng).ran);
  s.c.want[8] = true;  // and col.out_weight
  EXPECT_TRUE(check_case(s.c, s.rng).ran);
}

// No position (B = 0) and a dim whose qkv weight, 3 D^2 elements, overflows int64: backward_cpu
// computed 3 D D in int64 to zero the weight gradients, signed overflow (UBSan), even with none
// wanted. validate() may refuse such a dim (no such weight can exist) or the backward must skip it.
TEST(ApiFuzzFound, NoPositionsAndADimWhoseWeightsOverflow) {
  for (int64_t D : {int64_t{3037000500}, int64_t{1} << 40, kI64Max}) {
    Small s(0, 0, 1, D, D);
    std::fill(s.c.want, s.c.want + 10, false);
    check_case(s.c, s.rng);
  }
}

// One size zero and the others' product beyond int64 (B H = 2^80, W = 0): B*H*W*D is 0, so
// validate_sizes passed it, then every entry point formed B*H (the row pass's sequences) or B*H*W
// left to right: signed overflow. It is refused (fastaxial.h's rule on the non-zero sizes).
TEST(ApiFuzzFound, AZeroSizeBesideAnOverflowingProduct) {
  const int64_t big = int64_t{1} << 40;
  for (Small s : {Small(big, big, 0, 1, 1), Small(big, 0, big, 1, 1), Small(0, big, big, 1, 1),
                  Small(big, big, 0, 8, 2)}) {
    std::fill(s.c.null_ptr, s.c.null_ptr + 12, true);
    std::fill(s.c.want, s.c.want + 10, false);
    check_case(s.c, s.rng);
  }
}

// dropout_mask without dropout: its N heads L^2 elements (B W heads H^2 = 20 2^64 for the column
// pass at H = 2^32) wrapped around in uint64 to 0, and it returned ok with nothing written and a
// null output; validate_sizes bounds that count only where dropout > 0.
// At H = 3037000499 (B 2, W 5, D 1) the count wrapped to a huge number instead, and it wrote that
// many floats: past any buffer (a segmentation fault).
TEST(ApiFuzzFound, DropoutMaskWhoseCountWraps) {
  for (int64_t H : {int64_t{1} << 32, int64_t{3037000499}}) {
    SCOPED_TRACE(H);
    Small s(2, H, 5, 2, 2);
    EXPECT_EQ(dropout_mask(s.c.p, 1, nullptr).code, StatusCode::kInvalidArgument);
    Guarded out(16, 0, nullptr);
    EXPECT_EQ(dropout_mask(s.c.p, 1, out.data()).code, StatusCode::kInvalidArgument);
    EXPECT_TRUE(out.untouched());
  }
}

// The forward plan's weight planes, 8 D^2 floats a staged pass, computed in size_t without a check:
// at D = 2^30 (head dim 256, so the staged path) they wrapped to 0 bytes, and make_plan returned a
// plan whose workspace holds less than its own regions.
TEST(ApiFuzzFound, PlanWeightPlanesThatOverflowSizeT) {
  Small s(1, 1, 1, int64_t{1} << 30, int64_t{1} << 22);
  check_case(s.c, s.rng);
  const AxialParams& p = s.c.p;
  if (!validate_sizes(p).ok()) return;  // refused as too large: fine
  for (const DeviceCaps& dev : devices()) {
    CudaPlan plan;
    const Status st = make_plan(p, dev, {}, &plan);
    if (st.ok()) {
      EXPECT_TRUE(sound_plan(plan, p)) << "sms " << dev.sms;
    } else {
      EXPECT_EQ(st.code, StatusCode::kInvalidArgument) << st.message;
    }
  }
}

// The backward plan's weight planes, 128 D^2 bytes on a Hopper build, checked only for D^2 <=
// SIZE_MAX / 16: at D = 512829680 (B 1, H 4, W 2, head dim 1) they wrapped around, and
// make_backward_plan returned a workspace of less than its own regions.
TEST(ApiFuzzFound, BackwardPlanWeightPlanesThatOverflowSizeT) {
  Small s(1, 4, 2, 512829680, 512829680);
  check_case(s.c, s.rng);
  const AxialParams& p = s.c.p;
  if (!validate_sizes(p).ok()) return;  // refused as too large: fine
  for (const DeviceCaps& dev : devices()) {
    CudaBackwardPlan plan;
    const Status st = make_backward_plan(p, dev, &plan);
    if (st.ok()) {
      EXPECT_TRUE(sound_plan(plan, p)) << "sms " << dev.sms;
    } else {
      EXPECT_NE(st.code, StatusCode::kOk);
    }
  }
}

}  // namespace
}  // namespace fastaxial::test
