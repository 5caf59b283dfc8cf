/* The x86-64 level the CPU kernels run at (cpu_dtype.h, FO_ENTRY), and
 * a test hook: the conversions of cpu_dtype.h at a chosen level, which
 * tests/test_dtype.py calls through ctypes and checks against torch's. */
#define _DEFAULT_SOURCE /* syscall() outside strict ISO C */
#include <stdlib.h>

#include "cpu_dtype.h"
#include "cpu_amx.h"

#if FO_LEVEL == 0
#if FO_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* The highest level at most cap, of those up to hw (the levels are a chain:
 * 0, 3, 4, 5, 6). */
static int capped(int cap, int hw) {
  const int l = cap < hw ? cap : hw;
  return l >= FO_ISA_V3 ? l : FO_ISA_BASE;
}

/* Whether this thread's process may run AMX tiles: the CPU has AMX-TILE and
 * AMX-BF16, and Linux grants the tile data's state (XSTATE component 18) to
 * the process, which it asks here (arch_prctl ARCH_REQ_XCOMP_PERM; without
 * the grant the first tile instruction faults; the grant is for the whole
 * process, its threads now and later). A software build of the tiles
 * (tools/probes/amx_emulate.h forced in) takes them on any CPU. */
static int amx_usable(void) {
#if defined(FO_AMX_EMULATE)
  return 1;
#elif FO_AMX && defined(__GNUC__) && !defined(__clang__)
  enum { ARCH_REQ_XCOMP_PERM_ = 0x1023, XFEATURE_XTILEDATA_ = 18 }; /* <asm/prctl.h>, Linux 5.16 */
  return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
         syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM_, XFEATURE_XTILEDATA_) == 0;
#else
  return 0;
#endif
}

static int detect(void) {
  int level = FO_ISA_BASE;
#if FO_X86_LEVELS && defined(__GNUC__) && !defined(__clang__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4"))
    level = !__builtin_cpu_supports("avx512bf16") ? FO_ISA_V4 : amx_usable() ? FO_ISA_AMX : FO_ISA_V4_BF16;
  else if (__builtin_cpu_supports("x86-64-v3"))
    level = FO_ISA_V3;
#endif
  const char *env = getenv("FUSEDOPS_CPU_ISA");
  if (env && *env) level = capped(atoi(env), level);
  return level;
}

static int level = -1; /* -1: not yet detected */

int fo_cpu_isa(void) {
  int l = __atomic_load_n(&level, __ATOMIC_RELAXED);
  if (l < 0) { /* every thread that gets here computes the same */
    l = detect();
    __atomic_store_n(&level, l, __ATOMIC_RELAXED);
  }
  return l;
}

static int stream_mode = -1; /* FUSEDOPS_CPU_STREAM: 0, 1 (the default) or 2 */

int fo_cpu_stream(int64_t bytes) {
  int m = __atomic_load_n(&stream_mode, __ATOMIC_RELAXED);
  if (m < 0) {
    const char *env = getenv("FUSEDOPS_CPU_STREAM");
    m = env && *env ? atoi(env) : 1;
    m = m < 0 ? 0 : m > 2 ? 2 : m;
    __atomic_store_n(&stream_mode, m, __ATOMIC_RELAXED);
  }
  return m == 2 || (m == 1 && bytes >= ((int64_t)FO_STREAM_MIB << 20));
}

/* Runs the kernels at min(cap, what the CPU supports) from now on (not while
 * a kernel runs); returns the level in effect. */
int fo_cpu_set_isa(int cap) {
  __atomic_store_n(&level, -1, __ATOMIC_RELAXED);
  const int l = capped(cap, fo_cpu_isa());
  __atomic_store_n(&level, l, __ATOMIC_RELAXED);
  return l;
}

#endif

/* dst = src converted, n elements: 16-bit (fo_dtype 1 or 2) to fp32 when
 * widen, else fp32 to 16-bit; in blocks and a tail, as the kernels do. */
void FO_FN(fo_convert_rows)(int t, int widen, const void *src, void *dst, int64_t n) {
  if (widen) fo_load_row((fo_dtype)t, src, (float *)dst, n);
  else fo_store_row((fo_dtype)t, dst, (const float *)src, n);
}

#if FO_LEVEL == 0
FO_DECLARE(void, fo_convert_rows, (int t, int widen, const void *src, void *dst, int64_t n))

/* The same at level isa, which must not be above fo_cpu_isa(). Returns 0, or
 * -1 (nothing done) for a level or dtype out of range. */
int fo_cpu_convert(int isa, int t, int widen, const void *src, void *dst, int64_t n) {
  if (isa > fo_cpu_isa() || (t != FO_F16 && t != FO_BF16)) return -1;
  FO_PICK(isa, fo_convert_rows, (t, widen, src, dst, n));
  return 0;
}
#endif
