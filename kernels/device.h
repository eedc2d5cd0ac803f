/* Where the ops run: --device auto|cpu|cuda[:N].
 *
 * The CPU backend is always there. The CUDA backend is a plugin,
 * build/libaerie-cuda.so (make cuda), opened with dlopen only when asked
 * for, so a machine without the CUDA toolkit or a GPU builds and runs
 * everything else. "auto" takes CUDA device 0 when the plugin opens and
 * a GPU is usable, and the CPU otherwise, and says why. */
#ifndef AERIE_KERNELS_DEVICE_H
#define AERIE_KERNELS_DEVICE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

/* What a CUDA device reports when it is opened. */
typedef struct kn_device_info {
    char name[256];
    int index; /* cuda:N */
    int cc_major, cc_minor;
    uint64_t total_bytes;                /* the device's memory */
    uint64_t free_bytes;                 /* free when it was opened */
    int driver_version, runtime_version; /* 12080 is 12.8; 0: unknown */
} kn_device_info;

/* The backend ABI the plugin was built with (backend.h KN_BACKEND_ABI),
 * a const uint32_t it exports. kn_device_open reads it right after
 * dlopen (which has run the plugin's static initializers, and nothing
 * else of it) and refuses a plugin without it or of another version,
 * saying to rebuild the plugin with this libaerie (make cuda). */
#define KN_CUDA_ABI "kn_cuda_abi"
/* The plugin's entry point: opens device `index`, makes it the
 * backend's, and fills info. Errors are one line in err. */
#define KN_CUDA_ENTRY "kn_cuda_open"
typedef int (*kn_cuda_open_fn)(int index, const kn_backend **be, kn_device_info *info, ae_error *err);
/* And its copy bandwidth: GB/s of device-to-device copies of `bytes`,
 * counting bytes read and written (0: the buffers do not fit). */
#define KN_CUDA_COPY_GBPS "kn_cuda_copy_gbps"
typedef double (*kn_cuda_copy_gbps_fn)(size_t bytes, int reps);

typedef enum kn_device_kind { KN_DEVICE_CPU = 0, KN_DEVICE_CUDA = 1 } kn_device_kind;

typedef struct kn_device {
    kn_device_kind kind;
    const kn_backend *be;
    kn_device_info info;            /* CUDA only */
    char name[32];                  /* "cpu" or "cuda:N": what --print-config shows */
    char why[AE_ERR_MAX + 64];      /* auto only: why it chose what it chose */
    kn_cuda_copy_gbps_fn copy_gbps; /* CUDA only */
} kn_device;

/* Resolves spec ("auto", "cpu", "cuda", "cuda:N"). An explicit cuda that
 * cannot be had is an error naming the reason; auto falls back to the CPU
 * and records the reason in out->why. */
int kn_device_open(const char *spec, kn_device *out, ae_error *err);

/* A service's --device: opens c's "device", replaces "auto" with what it
 * chose, and logs the choice (and why, for auto) and the GPU it opened. */
struct config; /* services/core/config.h */
int kn_device_from_cfg(struct config *c, kn_device *out, ae_error *err);

/* The plugin's path: $AERIE_CUDA_LIB, else libaerie-cuda.so beside the
 * running program or one folder up (build/asan/ binaries use build/'s). */
int kn_device_plugin_path(char *out, size_t n, ae_error *err);

#endif
