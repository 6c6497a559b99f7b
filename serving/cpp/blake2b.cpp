// BLAKE2b (RFC 7693, unkeyed) and streamrec's stable id hash (stream/ids.py), without dependencies.
//
// stable_hash(text) = the first 8 bytes of BLAKE2b with an 8-byte digest (digest_size=8 is its own
// parameter block, not a truncated 64-byte digest) of the UTF-8 text, read as a little-endian uint64,
// with bit 63 cleared: a non-negative int64.
#include "blake2b.h"

#include <cstring>

namespace {

constexpr uint64_t kIV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

constexpr uint8_t kSigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

inline uint64_t rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

inline uint64_t load64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void compress(uint64_t h[8], const uint8_t block[128], uint64_t t, bool last) {
  uint64_t v[16], m[16];
  for (int i = 0; i < 8; ++i) {
    v[i] = h[i];
    v[i + 8] = kIV[i];
  }
  v[12] ^= t;  // the high word of the 128-bit counter stays 0: inputs are far below 2^64 bytes
  if (last) v[14] = ~v[14];
  for (int i = 0; i < 16; ++i) m[i] = load64(block + 8 * i);
  auto g = [&](int a, int b, int c, int d, uint64_t x, uint64_t y) {
    v[a] = v[a] + v[b] + x;
    v[d] = rotr(v[d] ^ v[a], 32);
    v[c] = v[c] + v[d];
    v[b] = rotr(v[b] ^ v[c], 24);
    v[a] = v[a] + v[b] + y;
    v[d] = rotr(v[d] ^ v[a], 16);
    v[c] = v[c] + v[d];
    v[b] = rotr(v[b] ^ v[c], 63);
  };
  for (int r = 0; r < 12; ++r) {
    const uint8_t* s = kSigma[r];
    g(0, 4, 8, 12, m[s[0]], m[s[1]]);
    g(1, 5, 9, 13, m[s[2]], m[s[3]]);
    g(2, 6, 10, 14, m[s[4]], m[s[5]]);
    g(3, 7, 11, 15, m[s[6]], m[s[7]]);
    g(0, 5, 10, 15, m[s[8]], m[s[9]]);
    g(1, 6, 11, 12, m[s[10]], m[s[11]]);
    g(2, 7, 8, 13, m[s[12]], m[s[13]]);
    g(3, 4, 9, 14, m[s[14]], m[s[15]]);
  }
  for (int i = 0; i < 8; ++i) h[i] ^= v[i] ^ v[i + 8];
}

}  // namespace

namespace streamrec {

void blake2b(const void* data, size_t len, uint8_t* out, size_t outlen) {
  uint64_t h[8];
  std::memcpy(h, kIV, sizeof h);
  h[0] ^= 0x01010000ULL ^ static_cast<uint64_t>(outlen);  // fanout 1, depth 1, no key, digest length
  const auto* p = static_cast<const uint8_t*>(data);
  uint8_t block[128];
  uint64_t t = 0;
  while (len > 128) {  // every full block but the last one
    t += 128;
    compress(h, p, t, false);
    p += 128;
    len -= 128;
  }
  std::memset(block, 0, sizeof block);
  std::memcpy(block, p, len);
  t += len;
  compress(h, block, t, true);
  for (size_t i = 0; i < outlen; ++i) out[i] = static_cast<uint8_t>(h[i / 8] >> (8 * (i % 8)));
}

int64_t stable_hash(const std::string& text) {
  uint8_t d[8];
  blake2b(text.data(), text.size(), d, 8);
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | d[i];
  return static_cast<int64_t>(v & 0x7fffffffffffffffULL);
}

}  // namespace streamrec
