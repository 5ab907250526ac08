/* mkmix SIZE PATH: 64 KiB blocks: 1/4 random, 1/2 text-like (compressible), 1/4 zero (holes). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
int main(int argc, char **argv) {
  if (argc < 3) return 2;
  uint64_t total = strtoull(argv[1], 0, 10), s = 88172645463325252ull;
  int fd = open(argv[2], O_WRONLY | O_CREAT | O_TRUNC, 0644); if (fd < 0) return 1;
  if (ftruncate(fd, total)) return 1;
  static char buf[65536]; char line[200];
  for (uint64_t off = 0, i = 0; off < total; off += 65536, i++) {
    int k = i % 4;
    if (k == 3) continue;
    if (k == 0) { for (int j = 0; j < 65536 / 8; j++) { s ^= s >> 12; s ^= s << 25; s ^= s >> 27; ((uint64_t *)buf)[j] = s * 0x2545F4914F6CDD1Dull; } }
    else { int n = 0; while (n < 65536) { s ^= s >> 12; s ^= s << 25; s ^= s >> 27; int l = snprintf(line, sizeof line, "%llu INFO block %llu: request served in %llu us\n", (unsigned long long)(off + n), (unsigned long long)i, (unsigned long long)(s % 5000)); if (n + l > 65536) l = 65536 - n; memcpy(buf + n, line, l); n += l; } }
    if (pwrite(fd, buf, 65536, off) != 65536) return 1;
  }
  return close(fd);
}
