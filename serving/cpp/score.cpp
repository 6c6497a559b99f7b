// streamrec_score: score a request with a TorchScript serving artifact from C++, as serving/model.py does.
//
//   streamrec_score score ARTIFACT_DIR REQUEST_DIR [--repeat N]
//       ARTIFACT_DIR: a version directory of `streamrec refresh` in the torchscript format (scorer.pt,
//       cold_rows.npy (num_rows, D + 1) float32, manifest.json). REQUEST_DIR: values.npy (N,) int64 global
//       rows, offsets.npy (F + F*B + 1,) int64 (the user row's F bags, then the candidates' F*B: the scorer's
//       input layout 2, learner/scorer.py), dense.npy (B, Dd) float32, as serving/cpp_request.py writes them
//       (serving/features.py's FeatureEncoder.encode). Prints B click probabilities, one per line, "%.9g"
//       (float32 round-trips exactly); with --repeat, the mean forward time goes to stderr. An artifact whose
//       manifest does not declare scorer input_layout 2 (published before it) is refused: republish it.
//   streamrec_score hash TEXT...
//       Prints stream.ids.stable_hash of each raw id's text, one per line.
//
// Scoring follows serving.model.ScoringModel.score_request on a fresh artifact (no learner deltas): rows found
// among the scorer's hot_ids buffer are looked up inside the scorer; the others are gathered from the
// memory-mapped cold rows and handed in as given_rows with given_mask set.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <torch/script.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <regex>
#include <stdexcept>
#include <string>
#include <vector>

#include "blake2b.h"

namespace {

// -- .npy, memory-mapped ----------------------------------------------------------------------------
// A little-endian, C-order array of one known dtype (format 1.0, 2.0 or 3.0), mapped read-only.
struct Npy {
  void* map = nullptr;
  size_t map_len = 0;
  const char* data = nullptr;
  std::string descr;
  std::vector<int64_t> shape;

  Npy(const Npy&) = delete;
  Npy& operator=(const Npy&) = delete;
  Npy() = default;
  ~Npy() {
    if (map != nullptr) munmap(map, map_len);
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
};

[[noreturn]] void fail(const std::string& msg) { throw std::runtime_error(msg); }

std::unique_ptr<Npy> open_npy(const std::string& path, const std::string& want_descr, size_t want_dims) {
  int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) fail(path + ": cannot open (" + std::strerror(errno) + ")");
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    close(fd);
    fail(path + ": cannot stat");
  }
  auto npy = std::make_unique<Npy>();
  npy->map_len = static_cast<size_t>(st.st_size);
  if (npy->map_len < 12) {
    close(fd);
    fail(path + ": too short for a .npy file");
  }
  npy->map = mmap(nullptr, npy->map_len, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (npy->map == MAP_FAILED) {
    npy->map = nullptr;
    fail(path + ": mmap failed");
  }
  const auto* p = static_cast<const unsigned char*>(npy->map);
  if (std::memcmp(p, "\x93NUMPY", 6) != 0) fail(path + ": not a .npy file");
  size_t hlen, start;
  if (p[6] == 1) {
    hlen = p[8] | (p[9] << 8);
    start = 10;
  } else if (p[6] == 2 || p[6] == 3) {
    hlen = p[8] | (p[9] << 8) | (p[10] << 16) | (static_cast<size_t>(p[11]) << 24);
    start = 12;
  } else {
    fail(path + ": unknown .npy version " + std::to_string(p[6]));
  }
  if (start + hlen > npy->map_len) fail(path + ": truncated header");
  std::string header(reinterpret_cast<const char*>(p + start), hlen);
  std::smatch m;
  if (!std::regex_search(header, m, std::regex("'descr':\\s*'([^']*)'"))) fail(path + ": no descr");
  npy->descr = m[1];
  if (npy->descr != want_descr) fail(path + ": dtype " + npy->descr + ", expected " + want_descr);
  if (!std::regex_search(header, m, std::regex("'fortran_order':\\s*(True|False)")) || m[1] != "False")
    fail(path + ": not C-order");
  if (!std::regex_search(header, m, std::regex("'shape':\\s*\\(([^)]*)\\)"))) fail(path + ": no shape");
  std::string dims = m[1];
  std::regex num("\\d+");
  for (auto it = std::sregex_iterator(dims.begin(), dims.end(), num); it != std::sregex_iterator(); ++it)
    npy->shape.push_back(std::stoll(it->str()));
  if (npy->shape.size() != want_dims)
    fail(path + ": " + std::to_string(npy->shape.size()) + " dimensions, expected " + std::to_string(want_dims));
  size_t item = want_descr == "<i8" ? 8 : want_descr == "|b1" ? 1 : 4;
  size_t bytes = static_cast<size_t>(npy->numel()) * item;
  if (start + hlen + bytes > npy->map_len) fail(path + ": truncated data");
  npy->data = reinterpret_cast<const char*>(p + start + hlen);
  return npy;
}

// A tensor viewing (not owning, not writing) a mapped array: it must not outlive the Npy.
torch::Tensor view(const Npy& a, torch::ScalarType dtype) {
  return torch::from_blob(const_cast<char*>(a.data), a.shape, torch::TensorOptions().dtype(dtype));
}

// -- the manifest's scorer input layout ---------------------------------------------------------------
// The scorer's input layout this program hands in (learner/scorer.py USER_ROW_LAYOUT); manifest.json states its
// scorer's as "input_layout" inside "scorer" (absent: a scorer from before it, which takes another offsets layout).
constexpr int kUserRowLayout = 2;

void check_layout(const std::string& artifact) {
  const std::string path = artifact + "/manifest.json";
  std::ifstream in(path);
  if (!in) fail(path + ": cannot open");
  std::stringstream text;
  text << in.rdbuf();
  const std::string manifest = text.str();
  std::smatch m;
  // "scorer": {...} holds numbers, a list of numbers and no nested object: its body ends at the first '}'.
  if (!std::regex_search(manifest, m, std::regex("\"scorer\"\\s*:\\s*\\{([^}]*)\\}")))
    fail(path + ": no scorer settings");
  const std::string scorer = m[1];
  int layout = 1;
  if (std::regex_search(scorer, m, std::regex("\"input_layout\"\\s*:\\s*(\\d+)"))) layout = std::stoi(m[1]);
  if (layout != kUserRowLayout)
    fail(path + ": scorer input_layout " + std::to_string(layout) + ", this program hands in layout " +
         std::to_string(kUserRowLayout) + " (the user row's bags once, then the candidates'); the artifact was " +
         "published before it: republish with `streamrec refresh --now`");
}

// -- scoring -----------------------------------------------------------------------------------
int score(const std::string& artifact, const std::string& request, int repeat) {
  torch::jit::Module scorer = torch::jit::load(artifact + "/scorer.pt", torch::kCPU);
  check_layout(artifact);
  scorer.eval();
  auto cold_npy = open_npy(artifact + "/cold_rows.npy", "<f4", 2);
  auto values_npy = open_npy(request + "/values.npy", "<i8", 1);
  auto offsets_npy = open_npy(request + "/offsets.npy", "<i8", 1);
  auto dense_npy = open_npy(request + "/dense.npy", "<f4", 2);

  torch::InferenceMode guard;
  torch::Tensor cold = view(*cold_npy, torch::kFloat32);  // (num_rows, D + 1): pages read on demand
  torch::Tensor values = view(*values_npy, torch::kInt64);
  torch::Tensor offsets = view(*offsets_npy, torch::kInt64);
  torch::Tensor dense = view(*dense_npy, torch::kFloat32);
  const int64_t num_rows = cold.size(0);
  if (values.numel() && (values.min().item<int64_t>() < 0 || values.max().item<int64_t>() >= num_rows))
    fail("values: rows must lie in [0, " + std::to_string(num_rows) + ")");

  auto forward = [&]() {
    // serving.model.ScoringModel._given: hot rows stay in the scorer, the others are handed in.
    torch::Tensor hot_ids = scorer.attr("hot_ids").toTensor();  // (H + 1,) sorted, last = sentinel
    torch::Tensor pos = torch::searchsorted(hot_ids, values);
    torch::Tensor mask = hot_ids.index_select(0, pos).ne(values);  // (N,) bool: not hot
    torch::Tensor given = torch::zeros({values.size(0), cold.size(1)}, torch::kFloat32);
    torch::Tensor cold_idx = mask.nonzero().squeeze(1);
    if (cold_idx.numel()) given.index_copy_(0, cold_idx, cold.index_select(0, values.index_select(0, cold_idx)));
    return scorer.forward({values, offsets, dense, given, mask}).toTensor();
  };

  torch::Tensor probs = forward();
  if (repeat > 0) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < repeat; ++i) probs = forward();
    double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    std::fprintf(stderr, "forward: %.1f us mean over %d calls (B=%lld, N=%lld)\n", us / repeat, repeat,
                 static_cast<long long>(probs.size(0)), static_cast<long long>(values.size(0)));
  }
  probs = probs.contiguous();
  const float* p = probs.data_ptr<float>();
  for (int64_t i = 0; i < probs.numel(); ++i) std::printf("%.9g\n", static_cast<double>(p[i]));
  return 0;
}

int usage() {
  std::fprintf(stderr,
               "usage: streamrec_score score ARTIFACT_DIR REQUEST_DIR [--repeat N]\n"
               "       streamrec_score hash TEXT...\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage();
  std::string cmd = argv[1];
  try {
    if (cmd == "hash") {
      for (int i = 2; i < argc; ++i)
        std::printf("%lld\n", static_cast<long long>(streamrec::stable_hash(argv[i])));
      return 0;
    }
    if (cmd == "score" && (argc == 4 || (argc == 6 && std::string(argv[4]) == "--repeat")))
      return score(argv[2], argv[3], argc == 6 ? std::stoi(argv[5]) : 0);
    return usage();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "streamrec_score: %s\n", e.what());
    return 1;
  }
}
