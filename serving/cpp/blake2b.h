// BLAKE2b and streamrec's stable id hash (stream/ids.py): see blake2b.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace streamrec {

// Unkeyed BLAKE2b of data[0:len] with an outlen-byte digest (1..64), written to out.
void blake2b(const void* data, size_t len, uint8_t* out, size_t outlen);

// stream.ids.stable_hash of a raw id already turned into its text (str(value) in Python).
int64_t stable_hash(const std::string& text);

}  // namespace streamrec
