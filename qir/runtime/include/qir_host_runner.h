// qir_host_runner.h: the standalone executable a sanitizer build runs (QIR_HOST_RUNNER).
// Part of qir_host.h, which includes the parts in order after the toolkit headers; not
// usable on its own.
#pragma once

#if defined(QIR_HOST_RUNNER)
// Standalone-executable mode (sanitizer builds): an ASan runtime cannot be loaded into an
// uninstrumented Python, so the kernel runs in its own process on buffers malloc'd to their exact
// size, where ASan's redzones catch out-of-bounds indexing.
//   argv[1] (input): u32 grid[3], u32 block[3], u32 loops (Launch::loops), u32 nparams, then
//     per param u32 kind
//     (0 = buffer, 1 = int) and u64 nbytes followed by the bytes;
//   argv[2] (output): the buffers' final bytes, concatenated in parameter order.
extern "C" int QIR_HOST_RUNNER(const unsigned*, const unsigned*, void**, int);

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  FILE* in = std::fopen(argv[1], "rb");
  if (!in) return 2;
  unsigned dims[6], loops = 0, n = 0;
  if (std::fread(dims, sizeof(unsigned), 6, in) != 6 || std::fread(&loops, 4, 1, in) != 1 ||
      std::fread(&n, 4, 1, in) != 1)
    return 2;
  std::vector<void*> values(n);
  std::vector<void*> buffers(n, nullptr);
  std::vector<uint64_t> sizes(n, 0);
  for (unsigned i = 0; i < n; ++i) {
    unsigned kind = 0;
    if (std::fread(&kind, 4, 1, in) != 1 || std::fread(&sizes[i], 8, 1, in) != 1) return 2;
    void* data = std::malloc(sizes[i] ? sizes[i] : 1);
    if (sizes[i] && std::fread(data, 1, sizes[i], in) != sizes[i]) return 2;
    if (kind == 0) {
      buffers[i] = data;
      values[i] = &buffers[i];
    } else {
      values[i] = data;
    }
  }
  std::fclose(in);
  if (QIR_HOST_RUNNER(dims, dims + 3, values.data(), static_cast<int>(loops)) != 0) {
    std::fprintf(stderr, "%s\n", qir_host_error());
    return 3;
  }
  FILE* out = std::fopen(argv[2], "wb");
  if (!out) return 2;
  for (unsigned i = 0; i < n; ++i)
    if (buffers[i]) std::fwrite(buffers[i], 1, sizes[i], out);
  std::fclose(out);
  return 0;
}
#endif
