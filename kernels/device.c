/* --device: the CPU backend, or the CUDA plugin (device.h). */
#include "device.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../services/core/config.h"
#include "../services/core/log.h"
#include "backend.h"

#define PLUGIN_NAME "libaerie-cuda.so"

int kn_device_plugin_path(char *out, size_t n, ae_error *err) {
    const char *env = getenv("AERIE_CUDA_LIB");
    if (env && *env) {
        if ((size_t)snprintf(out, n, "%s", env) >= n) return err_set(err, "AERIE_CUDA_LIB is too long");
        return AE_OK;
    }
    char exe[4096];
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (len <= 0) return err_set(err, "cannot find the running program (/proc/self/exe)");
    exe[len] = '\0';
    char *slash = strrchr(exe, '/');
    if (!slash) return err_set(err, "cannot find the running program's folder");
    *slash = '\0';
    if ((size_t)snprintf(out, n, "%s/%s", exe, PLUGIN_NAME) >= n) return err_set(err, "plugin path too long");
    if (access(out, R_OK) == 0) return AE_OK;
    slash = strrchr(exe, '/');
    if (slash) {
        *slash = '\0';
        char up[4096];
        if ((size_t)snprintf(up, sizeof up, "%s/%s", exe, PLUGIN_NAME) < sizeof up && access(up, R_OK) == 0 &&
            (size_t)snprintf(out, n, "%s", up) < n)
            return AE_OK;
    }
    return AE_OK; /* the first place; dlopen then says it is missing */
}

static int parse_spec(const char *spec, kn_device_kind *kind, int *index, bool *is_auto, ae_error *err) {
    *is_auto = false;
    *index = 0;
    if (!spec || strcmp(spec, "auto") == 0) {
        *is_auto = true;
        *kind = KN_DEVICE_CUDA;
        return AE_OK;
    }
    if (strcmp(spec, "cpu") == 0) {
        *kind = KN_DEVICE_CPU;
        return AE_OK;
    }
    if (strncmp(spec, "cuda", 4) == 0) {
        *kind = KN_DEVICE_CUDA;
        if (spec[4] == '\0') return AE_OK;
        char *end;
        long v = spec[4] == ':' ? strtol(spec + 5, &end, 10) : -1;
        if (spec[4] == ':' && spec[5] >= '0' && spec[5] <= '9' && *end == '\0' && v < 1024) {
            *index = (int)v;
            return AE_OK;
        }
    }
    return err_set(err, "--device %s: expected auto, cpu, cuda or cuda:N", spec);
}

/* Whether plugin h was built with this libaerie's backend ABI
 * (backend.h): read before any function of it is called, since an entry
 * point or table of another version would be misread. */
static int check_abi(void *h, const char *path, ae_error *err) {
    const uint32_t *abi = (const uint32_t *)dlsym(h, KN_CUDA_ABI);
    if (!abi)
        return err_set(err,
                       "%s has no %s: it was built before the backend ABI was versioned, and this libaerie is "
                       "ABI %u (kernels/backend.h); rebuild the plugin with this libaerie: make cuda",
                       path, KN_CUDA_ABI, (unsigned)KN_BACKEND_ABI);
    if (*abi != KN_BACKEND_ABI)
        return err_set(err,
                       "%s was built for backend ABI %u, but this libaerie is ABI %u (kernels/backend.h); "
                       "rebuild the plugin with this libaerie: make cuda",
                       path, (unsigned)*abi, (unsigned)KN_BACKEND_ABI);
    return AE_OK;
}

/* Opens the plugin and device `index`. */
static int open_cuda(int index, kn_device *out, ae_error *err) {
    char path[4096];
    if (kn_device_plugin_path(path, sizeof path, err) != AE_OK) return AE_ERR;
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) return err_set(err, "cannot load the CUDA backend: %s (build it with make cuda)", dlerror());
    if (check_abi(h, path, err) != AE_OK) {
        dlclose(h);
        return AE_ERR;
    }
    kn_cuda_open_fn open_fn;
    void *sym = dlsym(h, KN_CUDA_ENTRY);
    memcpy(&open_fn, &sym, sizeof open_fn);
    if (!open_fn) {
        dlclose(h);
        return err_set(err, "%s has no %s", path, KN_CUDA_ENTRY);
    }
    sym = dlsym(h, KN_CUDA_COPY_GBPS);
    memcpy(&out->copy_gbps, &sym, sizeof out->copy_gbps);
    /* The plugin stays loaded: its backend table lives in it. */
    if (open_fn(index, &out->be, &out->info, err) != AE_OK) {
        dlclose(h);
        return AE_ERR;
    }
    out->kind = KN_DEVICE_CUDA;
    snprintf(out->name, sizeof out->name, "cuda:%d", index);
    return AE_OK;
}

int kn_device_open(const char *spec, kn_device *out, ae_error *err) {
    memset(out, 0, sizeof *out);
    kn_device_kind kind;
    int index;
    bool is_auto;
    if (parse_spec(spec, &kind, &index, &is_auto, err) != AE_OK) return AE_ERR;
    if (kind == KN_DEVICE_CUDA) {
        ae_error why = {{0}};
        if (open_cuda(index, out, &why) == AE_OK) {
            if (is_auto) snprintf(out->why, sizeof out->why, "a GPU is usable: %s", out->info.name);
            return AE_OK;
        }
        if (!is_auto) return err_set(err, "--device %s: %s", spec, why.msg);
        memset(out, 0, sizeof *out);
        snprintf(out->why, sizeof out->why, "%s", why.msg);
    }
    out->kind = KN_DEVICE_CPU;
    out->be = &kn_backend_cpu;
    snprintf(out->name, sizeof out->name, "cpu");
    return AE_OK;
}

int kn_device_from_cfg(struct config *c, kn_device *out, ae_error *err) {
    if (kn_device_open(config_str(c, "device"), out, err) != AE_OK) return AE_ERR;
    if (config_is_auto(c, "device")) {
        config_set_auto_str(c, "device", out->name);
        LOG_INFOF("device %s (auto: %s)", out->name, out->why);
    }
    if (out->kind == KN_DEVICE_CUDA)
        LOG_INFOF("device %s: %s, compute capability %d.%d, %llu MiB of %llu MiB free, driver %d, runtime %d",
                  out->name, out->info.name, out->info.cc_major, out->info.cc_minor,
                  (unsigned long long)(out->info.free_bytes >> 20), (unsigned long long)(out->info.total_bytes >> 20),
                  out->info.driver_version, out->info.runtime_version);
    return AE_OK;
}
