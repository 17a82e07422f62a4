// qir_host_exports.h: the C entry points host.py calls on a kernel library: the last
// error, sharing the Runtime, and one qir_launch_<kernel> per kernel (QIR_HOST_EXPORT).
// Part of qir_host.h, which includes the parts in order after the toolkit headers; not
// usable on its own.
#pragma once

// The calling thread's last launch error ("" after a launch that succeeded).
extern "C" __attribute__((visibility("default"))) const char* qir_host_error() {
  return qir_host::last_error();
}

// Sharing one Runtime between kernel libraries (host.py calls these right after loading one):
// qir_host_abi() says which libraries can share, qir_host_runtime() is the Runtime this library
// uses, and qir_host_share(r) makes it use r instead, when r is of the same build (returns 1).
extern "C" __attribute__((visibility("default"))) unsigned long long qir_host_abi() {
  return QIR_HOST_ABI;
}
extern "C" __attribute__((visibility("default"))) void* qir_host_runtime() {
  return qir_host::runtime();
}
extern "C" __attribute__((visibility("default"))) int qir_host_share(void* other) {
  auto* r = static_cast<qir_host::Runtime*>(other);
  if (QIR_HOST_ABI == 0 || r == nullptr || r->abi != QIR_HOST_ABI ||
      r->runtime_size != sizeof(qir_host::Runtime) || r->fibers_size != sizeof(qir_host::Fibers))
    return 0;
  qir_host::shared_runtime().store(r, std::memory_order_release);
  return 1;
}

#define QIR_HOST_EXPORT(name)                                                                \
  extern "C" __attribute__((visibility("default"))) int qir_launch_##name(                   \
      const unsigned* grid3, const unsigned* block3, void** params, int loops) {             \
    return qir_host::launch_kernel(&name, grid3, block3, params, loops);                     \
  }
