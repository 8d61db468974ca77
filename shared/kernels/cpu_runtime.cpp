// The library's own exports: its error message and what its OpenMP runtime sees (the tests
// check that it is torch's: one pool, sized by torch.set_num_threads).

#include "cpu_common.h"

// The kernels' signatures, space-separated (NORI_SIGNATURE).
extern "C" const char* nori_signatures() { return nori::signatures().c_str(); }

// The calling thread's last failure message (a kernel returned 1).
extern "C" const char* nori_last_error() { return nori::error_buffer(); }

// omp_get_max_threads() of the calling thread.
NORI_SIGNATURE(omp_max_threads, "");
extern "C" int nori_omp_max_threads() { return omp_get_max_threads(); }

// The team size a kernel's parallel loop runs with when given `threads`.
NORI_SIGNATURE(team_size, "P");
extern "C" int nori_team_size(int64_t threads) {
  int team = 1;
  nori::parallel_for(0, 1 << 20, 1, threads, [&](int64_t begin, int64_t) {
    if (begin == 0) team = omp_get_num_threads();
  });
  return team;
}
