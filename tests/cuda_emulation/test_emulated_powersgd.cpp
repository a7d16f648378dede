// PowerSGD's CUDA kernels (compress/cuda/PowerSgdKernels.cu and
// PowerSgdMatmul.cu) on the emulated GPU: Gram-Schmidt against torch's
// hook's steps computed in double, the one-pass reconstruction bit for bit
// against its sums in k order, the uncompressed tensors' unpacking bit for
// bit against its formula, and the opt-in products against double products
// (their sums run in another order than a naive loop's).
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "CudaEmulation.hpp"
#include "EmulatedTestUtil.hpp"
#include "compress/PowerSgdCodec.hpp"
#include "compress/cuda/CudaCodecs.hpp"

#include <catch2/catch.hpp>

namespace {

// torch's hook's Gram-Schmidt, in double: each column divided by (its norm +
// eps), then taken out of the later ones.
at::Tensor gramSchmidtReference(const at::Tensor& x, double eps) {
  at::Tensor y = x.to(at::kDouble).clone();
  const int64_t rank = y.size(1);
  for (int64_t i = 0; i < rank; ++i) {
    at::Tensor col = y.narrow(1, i, 1);
    col.div_(col.norm().item<double>() + eps);
    if (i + 1 < rank) {
      at::Tensor rest = y.narrow(1, i + 1, rank - i - 1);
      rest.sub_((col * rest).sum(0, true) * col);
    }
  }
  return y;
}

struct MatmulEnv {
  MatmulEnv() { setenv("XCOMM_POWERSGD_MATMUL", "xcomm", 1); }
  ~MatmulEnv() { unsetenv("XCOMM_POWERSGD_MATMUL"); }
};

// |got - want| within a float sum's rounding: 1e-5 of sum |terms| per entry.
void checkProduct(const at::Tensor& got, const at::Tensor& want, const at::Tensor& scale,
                  double tol) {
  at::Tensor err = (got.to(at::kDouble) - want).abs();
  at::Tensor bound = scale * tol + 1e-30;
  const double worst = (err / bound).max().item<double>();
  INFO("worst error / bound " << worst);
  CHECK(worst <= 1.0);
}

}  // namespace

TEST_CASE("emulated Gram-Schmidt matches torch's steps", "[emulated][powersgd]") {
  for (int64_t rows : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{2049}}) {
    for (int64_t rank : {int64_t{1}, int64_t{2}, int64_t{4}, int64_t{9}}) {
      for (auto dtype : {at::kFloat, at::kDouble}) {
        DYNAMIC_SECTION(rows << " x " << rank << (dtype == at::kFloat ? " float" : " double")) {
          at::Tensor x = emutest::randn(rows * rank, rows + rank).view({rows, rank}).to(dtype);
          const double eps = 1e-8;
          at::Tensor want = gramSchmidtReference(x, eps);
          REQUIRE(xcomm::cuda::gramSchmidt(x, eps));
          if (rows < rank) {
            // Columns beyond the rows' span are rounding noise scaled up:
            // any finite answer is as good as torch's.
            CHECK(x.isfinite().all().item<bool>());
          } else {
            const double tol = dtype == at::kFloat ? 2e-4 : 1e-10;
            const double worst = (x.to(at::kDouble) - want).abs().max().item<double>();
            INFO("worst difference " << worst);
            CHECK(worst <= tol);
            // Orthonormal up to eps, which shortens every column a little.
            at::Tensor gram = at::mm(x.t(), x).to(at::kDouble);
            const double off = (gram - at::eye(rank, at::kDouble)).abs().max().item<double>();
            CHECK(off <= (dtype == at::kFloat ? 2e-5 : 1e-6));
          }
        }
      }
    }
  }
}

TEST_CASE("emulated batched Gram-Schmidt: every matrix as alone, and whether it was finite",
          "[emulated][powersgd]") {
  // Shapes for the register kernel (several ranks: several launches), one
  // too tall for it (8193 x 4) and one of too high a rank for it (40 x 20):
  // those take the global-memory kernel.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {2048, 4}, {300, 4}, {8193, 4}, {50, 1}, {40, 20}, {1000, 4}, {0, 4}, {64, 8}, {3000, 2}};
  for (auto dtype : {at::kFloat, at::kDouble}) {
    DYNAMIC_SECTION(c10::toString(dtype)) {
      std::vector<at::Tensor> xs, wants;
      for (size_t i = 0; i < shapes.size(); ++i) {
        const auto [rows, rank] = shapes[i];
        at::Tensor x = emutest::randn(rows * rank, 40 + i).view({rows, rank}).to(dtype);
        if (i == 5) x[17][2] = std::numeric_limits<double>::infinity();
        if (i == 7) x[3][0] = std::numeric_limits<double>::quiet_NaN();
        wants.push_back(gramSchmidtReference(x, 1e-8));
        xs.push_back(x);
      }
      at::Tensor finite = at::full({static_cast<int64_t>(xs.size())}, false, at::kBool);
      REQUIRE(xcomm::cuda::gramSchmidtBatch(xs, 1e-8, finite));
      for (size_t i = 0; i < xs.size(); ++i) {
        INFO("matrix " << i << ": " << shapes[i].first << " x " << shapes[i].second);
        const bool wasFinite = i != 5 && i != 7;
        CHECK(finite[i].item<bool>() == wasFinite);
        if (!wasFinite) continue;
        const double tol = dtype == at::kFloat ? 2e-4 : 1e-10;
        const double worst = xs[i].numel() == 0
                                 ? 0.0
                                 : (xs[i].to(at::kDouble) - wants[i]).abs().max().item<double>();
        CHECK(worst <= tol);
      }
    }
  }
  CHECK_FALSE(xcomm::cuda::gramSchmidtBatch({at::zeros({4, 2}), at::zeros({4, 2}, at::kDouble)},
                                            0.0, at::Tensor()));  // mixed dtypes
}

TEST_CASE("emulated Gram-Schmidt declines what it does not handle", "[emulated][powersgd]") {
  CHECK_FALSE(xcomm::cuda::gramSchmidt(at::zeros({4, 65}), 0.0));  // rank above 64
  CHECK_FALSE(xcomm::cuda::gramSchmidt(at::zeros({4, 2}, at::kHalf), 0.0));
  CHECK_FALSE(xcomm::cuda::gramSchmidt(at::zeros({2, 4}).t(), 0.0));  // not contiguous
}

TEST_CASE("emulated reconstruction is D = P Q^T and err = M - D, bit for bit",
          "[emulated][powersgd]") {
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    for (bool withError : {false, true}) {
      for (bool finite : {true, false}) {
        DYNAMIC_SECTION(c10::toString(dtype) << (withError ? ", error feedback" : "")
                                             << (finite ? "" : ", not finite")) {
          const int64_t rows = 37, cols = 300, rank = 3;
          at::Tensor m = emutest::randn(rows * cols, 1).view({rows, cols}).to(dtype);
          at::Tensor p = emutest::randn(rows * rank, 2).view({rows, rank}).to(dtype);
          at::Tensor q = emutest::randn(cols * rank, 3).view({cols, rank}).to(dtype);
          at::Tensor err = withError ? emutest::randn(rows * cols, 4).view({rows, cols}).to(dtype)
                                     : at::Tensor();
          at::Tensor errBefore = withError ? err.clone() : at::Tensor();
          // The reference: sums in float (double for double), k in order.
          const auto acc = dtype == at::kDouble ? at::kDouble : at::kFloat;
          at::Tensor pa = p.to(acc), qa = q.to(acc), ma = m.to(acc);
          at::Tensor d = at::zeros({rows, cols}, acc);
          for (int64_t k = 0; k < rank; ++k) {
            d = d + pa.narrow(1, k, 1) * qa.narrow(1, k, 1).t();
          }
          at::Tensor approx = d.to(dtype);
          at::Tensor wantErr = (ma - approx.to(acc)).to(dtype);
          at::Tensor flag = at::full({}, finite, at::kBool);
          REQUIRE(xcomm::cuda::powersgdReconstruct(m, err, p, q, flag));
          if (finite) {
            CHECK(emutest::sameBits(m, approx));
            if (withError) CHECK(emutest::sameBits(err, wantErr));
          } else {
            CHECK(m.isnan().all().item<bool>());
            if (withError) CHECK(emutest::sameBits(err, errBefore));
          }
        }
      }
    }
  }
}

TEST_CASE("emulated products P = M Q and Q = M^T P", "[emulated][powersgd]") {
  MatmulEnv env;
  struct Case {
    int64_t rows, cols, rank;
    int64_t offset;  // elements before M, as a bucket holds it: any alignment
  };
  // P = M Q takes 8 rows per block (2 at rank 32) and 256 columns per step
  // times 4 (ranks 1-2), 2 (rank 4) or 1 (128 for double at rank 32):
  // partial last blocks and steps, ranks below their power of two, and
  // several steps each.
  const Case cases[] = {{64, 128, 4, 0}, {33, 130, 1, 0}, {200, 96, 7, 1}, {5, 1024, 32, 0},
                        {300, 8, 16, 0}, {37, 600, 4, 0}, {20, 520, 3, 1}, {9, 300, 2, 2},
                        {3, 2500, 2, 1}, {11, 2100, 1, 0}};
  for (const auto& c : cases) {
    for (auto dtype : {at::kFloat, at::kDouble}) {
      DYNAMIC_SECTION(c.rows << " x " << c.cols << " rank " << c.rank << " offset " << c.offset
                             << " " << c10::toString(dtype)) {
        at::Tensor storage = emutest::randn(c.offset + c.rows * c.cols, 9).to(dtype);
        at::Tensor m = storage.narrow(0, c.offset, c.rows * c.cols).view({c.rows, c.cols});
        at::Tensor q = emutest::randn(c.cols * c.rank, 10).view({c.cols, c.rank}).to(dtype);
        at::Tensor p = at::empty({c.rows, c.rank}, dtype);
        const double tol = dtype == at::kFloat ? 1e-5 : 1e-13;
        at::Tensor md = m.to(at::kDouble), qd = q.to(at::kDouble);

        REQUIRE(xcomm::cuda::powersgdProject(p, m, q));
        checkProduct(p, at::mm(md, qd), at::mm(md.abs(), qd.abs()), tol);
        at::Tensor again = at::empty_like(p);
        REQUIRE(xcomm::cuda::powersgdProject(again, m, q));
        CHECK(emutest::sameBits(again, p));  // a fixed order: the same bits every time

        at::Tensor pd = p.to(at::kDouble);
        at::Tensor q2 = at::empty_like(q);
        REQUIRE(xcomm::cuda::powersgdProjectBack(q2, m, p, at::full({}, true, at::kBool)));
        checkProduct(q2, at::mm(md.t(), pd), at::mm(md.abs().t(), pd.abs()), tol);

        at::Tensor kept = q.clone();
        REQUIRE(xcomm::cuda::powersgdProjectBack(kept, m, p, at::full({}, false, at::kBool)));
        CHECK(emutest::sameBits(kept, q));  // P not finite: Q keeps its warm start
      }
    }
  }
}

TEST_CASE("emulated products are opt-in", "[emulated][powersgd]") {
  unsetenv("XCOMM_POWERSGD_MATMUL");
  at::Tensor m = at::ones({4, 4}), q = at::ones({4, 2}), p = at::empty({4, 2});
  CHECK_FALSE(xcomm::cuda::powersgdProject(p, m, q));
}

namespace {

struct RouteEnv {
  explicit RouteEnv(bool matmul) {
    setenv("XCOMM_POWERSGD_ROUTE", "aten", 1);
    if (matmul) setenv("XCOMM_POWERSGD_MATMUL", "xcomm", 1);
  }
  ~RouteEnv() {
    unsetenv("XCOMM_POWERSGD_ROUTE");
    unsetenv("XCOMM_POWERSGD_MATMUL");
  }
};

struct Bucket {
  at::Tensor buffer;
  std::vector<at::Tensor> grads;
  std::vector<int64_t> keys;
};

// Two same-shaped matrices (one batch of Ps), another shape, and a bias.
Bucket makeBucket() {
  const std::vector<std::vector<int64_t>> shapes = {{64, 48}, {64, 48}, {100, 30}, {7}};
  int64_t total = 0;
  for (const auto& s : shapes) total += c10::multiply_integers(s);
  Bucket b;
  b.buffer = at::zeros({total});
  int64_t offset = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const int64_t n = c10::multiply_integers(shapes[i]);
    b.grads.push_back(b.buffer.narrow(0, offset, n).view(shapes[i]));
    b.keys.push_back(static_cast<int64_t>(i));
    offset += n;
  }
  return b;
}

void step(xcomm::PowerSgdCodec& codec, Bucket& b, uint64_t seed) {
  codec.setLayout(0, b.buffer, b.grads, b.keys);
  auto info =
      codec.prepare(0, b.buffer, codec.needsSeed(0) ? std::optional<uint64_t>(seed) : std::nullopt);
  at::Tensor q = codec.reduceP(0, info.wire.clone(), 1);
  codec.finish(0, q.clone(), 1);
}

}  // namespace

TEST_CASE("emulated PowerSGD device route gives the CPU route's steps", "[emulated][powersgd]") {
  for (bool matmul : {false, true}) {
    DYNAMIC_SECTION((matmul ? "xcomm products" : "ATen products")) {
      xcomm::PowerSgdOptions opts;
      opts.matrixApproximationRank = 4;
      xcomm::PowerSgdCodec cpu(opts);
      std::unique_ptr<xcomm::PowerSgdCodec> device;
      {
        RouteEnv env(matmul);  // read when the codec is made
        device = std::make_unique<xcomm::PowerSgdCodec>(opts);
      }
      RouteEnv env(matmul);  // and the products' switch at each call
      Bucket a = makeBucket(), b = makeBucket();
      for (int s = 0; s < 4; ++s) {
        at::Tensor g = emutest::randn(a.buffer.numel(), 70 + s);
        if (s == 2) g[5] = std::numeric_limits<float>::quiet_NaN();  // matrix 0 not finite
        a.buffer.copy_(g);
        b.buffer.copy_(g);
        step(cpu, a, 11);
        const uint64_t before = emu::launches();
        step(*device, b, 11);
        INFO("step " << s);
        // Three matrices of one rank: one Gram-Schmidt launch for the Qs and
        // one for the Ps (which also says which P was finite), one for the
        // bias after its allreduce, then per matrix the reconstruction, and
        // the products where xcomm runs them (P = M Q one kernel, Q = M^T P
        // two).
        CHECK(emu::launches() - before == 3 + 3 + (matmul ? 3 * 3 : 0));
        for (size_t i = 0; i < a.grads.size(); ++i) {
          INFO("tensor " << i);
          if (s == 2 && i == 0) {
            CHECK(b.grads[0].isnan().all().item<bool>());  // NaN on every rank, as the CPU's
            CHECK(a.grads[0].isnan().all().item<bool>());
            continue;
          }
          const double scale = a.grads[i].abs().max().item<double>();
          const double worst = (b.grads[i] - a.grads[i]).abs().max().item<double>();
          CHECK(worst <= 1e-4 * scale);
        }
      }
    }
  }
}

TEST_CASE("emulated unpacking of the uncompressed tensors after their allreduce",
          "[emulated][powersgd]") {
  // The bucket's entries 3..9 and 20..24 are uncompressed; the wire holds
  // their sums over 3 ranks in that order, one not finite each way.
  std::vector<int64_t> at;
  for (int64_t j = 3; j < 10; ++j) at.push_back(j);
  for (int64_t j = 20; j < 25; ++j) at.push_back(j);
  const auto n = static_cast<int64_t>(at.size());
  const at::Tensor index = at::tensor(at, at::kLong);
  const int64_t world = 3;
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    for (bool withError : {false, true}) {
      DYNAMIC_SECTION(c10::toString(dtype) << (withError ? " with error" : "")) {
        at::Tensor buffer = emutest::randn(30, 40).to(dtype);
        at::Tensor wire = (emutest::randn(n + 5, 41) * 3).to(dtype);  // P follows in the wire
        wire[2] = std::numeric_limits<double>::quiet_NaN();
        wire[8] = -std::numeric_limits<double>::infinity();
        at::Tensor error = withError ? emutest::randn(30, 42).to(dtype) : at::Tensor();
        // Expected: each entry by the formula, in double for double, else float.
        at::Tensor wantBuffer = buffer.clone();
        at::Tensor wantError = withError ? error.clone() : at::Tensor();
        const bool dbl = dtype == at::kDouble;
        const double inverse = dbl ? 1.0 / world : static_cast<double>(1.0f / world);
        for (int64_t i = 0; i < n; ++i) {
          const int64_t j = at[static_cast<size_t>(i)];
          const double s = wire[i].item<double>();
          const double product =
              dbl ? s * inverse
                  : static_cast<double>(static_cast<float>(s) * static_cast<float>(inverse));
          const at::Tensor avg = at::scalar_tensor(product, at::kDouble).to(dtype);
          if (withError && std::isfinite(avg.item<double>())) {
            const double g = buffer[j].item<double>(), a = avg.item<double>();
            const double diff =
                dbl ? g - a : static_cast<double>(static_cast<float>(g) - static_cast<float>(a));
            wantError[j] = at::scalar_tensor(diff, at::kDouble).to(dtype);
          }
          wantBuffer[j] = avg;
        }
        REQUIRE(xcomm::cuda::powersgdUnpackUncompressed(buffer, error, wire, index, world));
        CHECK(emutest::sameBits(buffer, wantBuffer));
        if (withError) CHECK(emutest::sameBits(error, wantError));
        CHECK(buffer[5].isnan().item<bool>());  // wire[2]: NaN in, NaN out
      }
    }
  }
  // What it does not take: the caller then runs its ATen ops.
  at::Tensor buffer = at::zeros({30});
  CHECK_FALSE(xcomm::cuda::powersgdUnpackUncompressed(buffer, at::Tensor(), at::zeros({3}), index,
                                                      world));  // wire too short
  CHECK_FALSE(xcomm::cuda::powersgdUnpackUncompressed(buffer, at::Tensor(), at::zeros({20}),
                                                      index.to(at::kInt), world));
  CHECK_FALSE(xcomm::cuda::powersgdUnpackUncompressed(buffer, at::zeros({30}, at::kDouble),
                                                      at::zeros({20}), index, world));
}
