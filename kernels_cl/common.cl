// Prepended to every kernels_cl/ program: weight loaders shared by the kernels.

// bf16 -> f32 is a 16-bit shift: bf16 is the top half of an IEEE f32.
inline float bf16_to_f32(ushort b) { return as_float(((uint)b) << 16); }
inline float8 bf16x8_to_f32(ushort8 b) { return as_float8(convert_uint8(b) << 16); }
inline float16 bf16x16_to_f32(ushort16 b) { return as_float16(convert_uint16(b) << 16); }
