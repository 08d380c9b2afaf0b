/* common/utf8.h — UTF-8 scanning with the "maximal subpart" rule that Python's and Rust's lossy
 * decoders (and so Hugging Face's detokenizers) follow: an invalid sequence becomes one U+FFFD for
 * the longest prefix that could have started a valid character, not one per byte. */
#ifndef PD_COMMON_UTF8_H
#define PD_COMMON_UTF8_H

#include <stddef.h>
#include <stdint.h>

/* Scans the character at s[0..n), n >= 1. Returns 1 for a valid character of *len bytes; 0 when
 * s[0..n) is a valid but incomplete prefix (*len = n); -1 for an invalid sequence whose maximal
 * subpart is *len bytes (≥ 1), to be replaced by one U+FFFD. */
static inline int pd_utf8_scan(const unsigned char *s, size_t n, size_t *len)
{
    unsigned char c = s[0];
    if (c < 0x80) {
        *len = 1;
        return 1;
    }
    size_t need;
    unsigned char lo = 0x80, hi = 0xbf; /* range of the second byte */
    if (c >= 0xc2 && c <= 0xdf) {
        need = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
        need = 3;
        lo = c == 0xe0 ? 0xa0 : 0x80;
        hi = c == 0xed ? 0x9f : 0xbf;
    } else if (c >= 0xf0 && c <= 0xf4) {
        need = 4;
        lo = c == 0xf0 ? 0x90 : 0x80;
        hi = c == 0xf4 ? 0x8f : 0xbf;
    } else {
        *len = 1;
        return -1;
    }
    for (size_t i = 1; i < need; i++) {
        if (i >= n) {
            *len = n;
            return 0;
        }
        unsigned char b = s[i];
        if (i == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xbf)) {
            *len = i;
            return -1;
        }
    }
    *len = need;
    return 1;
}

#endif
