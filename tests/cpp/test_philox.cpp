// Philox4x32-10 against the published Random123 known-answer vectors (kat_vectors, "philox4x32 10"),
// and the uniform mapping's range and exactness.
#include <cmath>

#include "check.h"
#include "specdec/philox.h"

using specdec::Philox4;

TEST_CASE("philox4x32_10 known-answer vectors") {
  struct Kat {
    Philox4 ctr;
    uint32_t key[2];
    uint32_t want[4];
  };
  const Kat kats[] = {
      {{{0, 0, 0, 0}}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}}, {0xffffffff, 0xffffffff}, {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}}, {0xa4093822, 0x299f31d0}, {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const Kat& k : kats) {
    const Philox4 r = specdec::philox4x32_10(k.ctr, k.key[0], k.key[1]);
    for (int i = 0; i < 4; ++i) CHECK_EQ(r.x[i], k.want[i]);
  }
}

TEST_CASE("philox counter layout: block, stream, offset words, seed key") {
  const uint64_t seed = 0x299f31d0a4093822ull, offset = 0x0370734413198a2eull;
  const Philox4 r = specdec::philox_block(seed, offset, 0x85a308d3u, 0x243f6a88u);
  CHECK_EQ(r.x[0], 0xd16cfe09u);
  CHECK_EQ(r.x[3], 0x24126ea1u);
  CHECK(specdec::philox_uniform_at(seed, offset, 0x85a308d3u, (uint64_t{0x243f6a88u} << 2) | 1) ==
        specdec::uniform_from_bits(0x94fdcceb));
}

TEST_CASE("uniform_from_bits is exact and strictly inside (0, 1)") {
  CHECK(specdec::uniform_from_bits(0) == std::ldexp(1.0f, -24));
  CHECK(specdec::uniform_from_bits(0xffffffffu) == 1.0f - std::ldexp(1.0f, -24));
  CHECK(specdec::uniform_from_bits(0xffffffffu) < 1.0f);
  for (uint32_t x = 0; x < (1u << 23); x += 4099) {
    const float u = specdec::uniform_from_bits(x << 9);
    CHECK(static_cast<double>(u) == (2.0 * x + 1.0) / 16777216.0);
  }
}

int main(int argc, char** argv) { return specdec_test::run_all(argc, argv); }
