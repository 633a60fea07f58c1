// Prepended to every kernels_cl/ program: weight loaders shared by the kernels.

// bf16 -> f32 is a 16-bit shift: bf16 is the top half of an IEEE f32.
inline float bf16_to_f32(ushort b) { return as_float(((uint)b) << 16); }
inline float8 bf16x8_to_f32(ushort8 b) { return as_float8(convert_uint8(b) << 16); }
inline float16 bf16x16_to_f32(ushort16 b) { return as_float16(convert_uint16(b) << 16); }

// The weight element type of kernels built with -DWEIGHT_TYPE=0|1|2 (f32 | bf16 | f16): wtype,
// and loaders that widen to f32 in registers (a weight is never converted in memory).
#ifdef WEIGHT_TYPE
#if WEIGHT_TYPE == 1
typedef ushort wtype;
#define LOADW16(i, p) bf16x16_to_f32(vload16((i), (p)))
#define LOADW1(p) bf16_to_f32(*(p))
#elif WEIGHT_TYPE == 2
typedef half wtype;  // loaded with vload_half, which needs no cl_khr_fp16
#define LOADW16(i, p) vload_half16((i), (p))
#define LOADW1(p) vload_half(0, (p))
#else
typedef float wtype;
#define LOADW16(i, p) vload16((i), (p))
#define LOADW1(p) (*(p))
#endif
#endif

// The norm weight of kernels that fold an RMSNorm into a GEMV, when it has its own type:
// -DNORM_TYPE=0|1|2 as WEIGHT_TYPE. ntype defaults to wtype.
#ifdef NORM_TYPE
#if NORM_TYPE == 1
typedef ushort ntype;
#define LOADN16(i, p) bf16x16_to_f32(vload16((i), (p)))
#define LOADN1(p) bf16_to_f32(*(p))
#elif NORM_TYPE == 2
typedef half ntype;
#define LOADN16(i, p) vload_half16((i), (p))
#define LOADN1(p) vload_half(0, (p))
#else
typedef float ntype;
#define LOADN16(i, p) vload16((i), (p))
#define LOADN1(p) (*(p))
#endif
#elif defined(WEIGHT_TYPE)
typedef wtype ntype;
#define LOADN16(i, p) LOADW16(i, p)
#define LOADN1(p) LOADW1(p)
#endif
