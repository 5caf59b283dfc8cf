/* The tuning knobs (tune.h): the struct the plans read, and its setter. */
#include "tune.h"

#include <stddef.h>
#include <string.h>

#define FO_TUNE_DEFAULT(name, lo, hi, dflt) dflt,
fo_tune fo_tuning = {FO_TUNE_KNOBS(FO_TUNE_DEFAULT)};

typedef struct knob {
  const char *name;
  size_t offset;
  int lo, hi, dflt;
} knob;
#define FO_TUNE_ENTRY(name, lo, hi, dflt) {#name, offsetof(fo_tune, name), lo, hi, dflt},
static const knob knobs[] = {FO_TUNE_KNOBS(FO_TUNE_ENTRY)};
#define N_KNOBS (sizeof knobs / sizeof knobs[0])

static int *field(const knob *k) { return (int *)((char *)&fo_tuning + k->offset); }

int fo_tune_set(const char *name, int value, int reset, int *old) {
  for (size_t i = 0; i < N_KNOBS; ++i) {
    const knob *k = &knobs[i];
    int *f = field(k);
    if (strcmp(k->name, name) != 0) continue;
    if (!reset && (value < k->lo || value > k->hi)) return -2;
    *old = *f;
    *f = reset ? k->dflt : value;
    return 0;
  }
  return -1;
}

const char *fo_tune_knob(int i, int *value, int *lo, int *hi, int *dflt) {
  if (i < 0 || (size_t)i >= N_KNOBS) return NULL;
  *value = *field(&knobs[i]);
  *lo = knobs[i].lo;
  *hi = knobs[i].hi;
  *dflt = knobs[i].dflt;
  return knobs[i].name;
}
