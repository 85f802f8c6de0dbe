/*
 * The C mirror of sarp/serving/http.py's fast parse of a `block_hashes` array
 * (sarp._native; sarp/native.py loads it): the JSON integers of the array as uint64,
 * or None on any doubt, and the general parse (the reference) then runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "../native.h"

/* u64_array(body, start, end[, u32]) -> bytes | None
 * The JSON integers between body[start:end] (the inside of an array: integers,
 * commas, JSON whitespace), as little-endian uint64 (negative ones as their int64
 * two's complement), or None for anything else JSON might hold there or that is out
 * of the uint64/int64 range: the caller then parses the body the general way, which
 * names what is wrong.  Strict JSON number grammar: no leading zeros, no '+'.  With
 * `u32` true (token ids), as uint32, and None when one is negative or over 2**32 - 1.
 * Two readings: bitmaps of the bytes (classify, parse_classified: an array of
 * unsigned integers, commas and white space, which is what engines and routers send)
 * and, for anything else (a sign, or bytes that make it None), a number at a time. */
static const uint64_t POW10[9] = {1, 10, 100, 1000, 10000, 100000, 1000000, 10000000,
                                  100000000};

enum { GIL_FREE_BYTES = 16 << 10 };

static int is_ws(uint8_t c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* How many of the 8 bytes at `p` are digits before the first that is not (0-8), and
 * (when 1-8) their value: up to 8 digits in a few word operations, where the digit
 * loop pays a multiply chain and a mispredicted exit per number.  A byte is a digit
 * when its high nibble is 3 and its low nibble plus 6 stays under 16; the run's bytes
 * shifted to the top of the word are the number with leading zeros, turned into its
 * value by the three multiplies of the 8-digit parse (Lemire, "Faster integer
 * parsing").  Reads 8 bytes: the caller checked they are inside the buffer. */
static inline int leading_digits(const uint8_t *p, uint64_t *value) {
    uint64_t chunk;
    memcpy(&chunk, p, 8);
    if (!PY_LITTLE_ENDIAN) return -1; /* (the words below are little-endian) */
    uint64_t bad = ((chunk & 0xF0F0F0F0F0F0F0F0ull) ^ 0x3030303030303030ull)
                   | (((chunk & 0x0F0F0F0F0F0F0F0Full) + 0x0606060606060606ull)
                      & 0x1010101010101010ull);
    /* bit 7 of every byte of `bad` that is not zero: the bytes that are not digits */
    uint64_t not_digit = (((bad & 0x7F7F7F7F7F7F7F7Full) + 0x7F7F7F7F7F7F7F7Full) | bad)
                         & 0x8080808080808080ull;
    int len = not_digit == 0 ? 8 : __builtin_ctzll(not_digit) >> 3;
    if (len == 0) return 0;
    uint64_t v = len == 8 ? chunk : chunk << (8 * (8 - len)); /* the rest shifted out */
    v = ((v & 0x0F0F0F0F0F0F0F0Full) * 2561) >> 8;
    v = ((v & 0x00FF00FF00FF00FFull) * 6553601) >> 16;
    *value = ((v & 0x0000FFFF0000FFFFull) * 42949672960001ull) >> 32;
    return len;
}

/* The array's integers when `*stop` is the array's ']': that byte ends every digit and
 * whitespace run by itself, so the loops need no bounds check (the common case, a
 * third of the time of the checked loop below).  Numbers of up to 15 digits whose
 * bytes (8 or 16 from the first digit) lie before `end`, the buffer's end, are read a
 * word at a time (leading_digits).  1 when all parsed, 0 on any doubt. */
static int parse_to_bracket(const uint8_t *p, const uint8_t *stop, const uint8_t *end,
                            uint64_t *vals, Py_ssize_t cap, Py_ssize_t *count) {
    Py_ssize_t n = 0;
    while (is_ws(*p)) p++;
    if (p == stop) {
        *count = 0;
        return 1;
    }
    for (;;) {
        int negative = *p == '-';
        p += negative;
        const uint8_t *digits = p;
        uint64_t v = 0;
        int word = end - p >= 8 ? leading_digits(p, &v) : -1, more = 0;
        if (word == 8) {  /* 8 digits, maybe more: the next word's run follows them */
            uint64_t low = 0;
            more = end - p >= 16 ? leading_digits(p + 8, &low) : -1;
            if (more >= 0 && more < 8) v = v * POW10[more] + low;
        }
        if (word > 0 && word < 8) {
            p += word;
        } else if (word == 8 && more >= 0 && more < 8) {
            p += 8 + more;  /* 8 to 15 digits */
        } else {
            v = 0;
            while ((uint8_t)(*p - '0') < 10) v = v * 10 + (uint64_t)(*p++ - '0');
        }
        Py_ssize_t len = p - digits;
        if (len == 0 || (len > 1 && digits[0] == '0')) return 0;
        if (len >= 20) {  /* 20 digits may overflow: parsed again, checked */
            uint64_t w = 0;
            int overflow = len > 20;
            for (const uint8_t *q = digits; q < p && !overflow; q++) {
                overflow |= __builtin_mul_overflow(w, (uint64_t)10, &w);
                overflow |= __builtin_add_overflow(w, (uint64_t)(*q - '0'), &w);
            }
            if (overflow) return 0;
            v = w;
        }
        if (negative) {
            if (v > (uint64_t)1 << 63) return 0;
            v = (uint64_t)0 - v;
        }
        if (n == cap) return 0;
        vals[n++] = v;
        while (is_ws(*p)) p++;
        if (p == stop) break;
        if (*p != ',') return 0;
        p++;
        while (is_ws(*p)) p++;
    }
    *count = n;
    return 1;
}

/* The value of the n (1-8) digits at q, whose 8 bytes are readable: the digits
 * shifted to the top of the word (what follows them shifted out, zeros in front),
 * then the three multiplies of leading_digits. */
static inline uint64_t digits_value(const uint8_t *q, int n) {
    uint64_t v;
    memcpy(&v, q, 8);
    v <<= 8 * (8 - n);
    v = ((v & 0x0F0F0F0F0F0F0F0Full) * 2561) >> 8;
    v = ((v & 0x00FF00FF00FF00FFull) * 6553601) >> 16;
    return ((v & 0x0000FFFF0000FFFFull) * 42949672960001ull) >> 32;
}

/* Which of the `len` bytes at p are digits, which commas and which '0', one bit a
 * byte, 64 to a word (bytes past `len` count as spaces); 0 when a byte is anything
 * but a digit, a comma or JSON white space (a sign, a dot, a letter: the caller's
 * byte loops decide those).  16 bytes a step with SSE2, which every x86-64 has;
 * elsewhere always 0. */
static int classify(const uint8_t *p, Py_ssize_t len, uint64_t *digits, uint64_t *commas,
                    uint64_t *zeros) {
    for (Py_ssize_t w = 0; 64 * w < len; w++) {
        uint8_t pad[64];
        const uint8_t *q = p + 64 * w;
        if (len - 64 * w < 64) {
            memset(pad, ' ', sizeof pad);
            memcpy(pad, q, (size_t)(len - 64 * w));
            q = pad;
        }
        uint64_t d = 0, c = 0, z = 0, known = 0;
#if defined(__SSE2__)
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            __m128i x = _mm_loadu_si128((const __m128i *)(q + 16 * k));
            __m128i off = _mm_sub_epi8(x, _mm_set1_epi8('0'));
            __m128i dig = _mm_cmpeq_epi8(_mm_min_epu8(off, _mm_set1_epi8(9)), off);
            __m128i com = _mm_cmpeq_epi8(x, _mm_set1_epi8(','));
            __m128i ws = _mm_or_si128(
                _mm_or_si128(_mm_cmpeq_epi8(x, _mm_set1_epi8(' ')),
                             _mm_cmpeq_epi8(x, _mm_set1_epi8('\n'))),
                _mm_or_si128(_mm_cmpeq_epi8(x, _mm_set1_epi8('\t')),
                             _mm_cmpeq_epi8(x, _mm_set1_epi8('\r'))));
            d |= (uint64_t)(uint16_t)_mm_movemask_epi8(dig) << (16 * k);
            c |= (uint64_t)(uint16_t)_mm_movemask_epi8(com) << (16 * k);
            z |= (uint64_t)(uint16_t)_mm_movemask_epi8(
                     _mm_cmpeq_epi8(off, _mm_setzero_si128())) << (16 * k);
            known |= (uint64_t)(uint16_t)_mm_movemask_epi8(
                         _mm_or_si128(_mm_or_si128(dig, com), ws)) << (16 * k);
        }
#else
        (void)q;
        return 0;  /* without SSE2: the word-at-a-time loops beat a byte loop */
#endif
        if (known != ~(uint64_t)0) return 0;
        digits[w] = d;
        commas[w] = c;
        zeros[w] = z;
    }
    return 1;
}

/* Bit i of the result: the parity of bits 0..i of x. */
static inline uint64_t prefix_xor(uint64_t x) {
    x ^= x << 1;
    x ^= x << 2;
    x ^= x << 4;
    x ^= x << 8;
    x ^= x << 16;
    return x ^ (x << 32);
}

/* The value of the L (1-20) digits at q, or 0 with *overflow set past uint64; reads
 * 24 bytes at q when `room` says they are inside the buffer, else a byte at a time. */
static uint64_t long_digits(const uint8_t *q, int L, int room, int *overflow) {
    uint64_t v = 0;
    if (!room) {
        for (int i = 0; i < L; i++) {
            *overflow |= __builtin_mul_overflow(v, (uint64_t)10, &v);
            *overflow |= __builtin_add_overflow(v, (uint64_t)(q[i] - '0'), &v);
        }
    } else if (L <= 8) {
        v = digits_value(q, L);
    } else if (L <= 16) {
        v = digits_value(q, 8) * POW10[L - 8] + digits_value(q + 8, L - 8);
    } else {  /* 17-20: only 20 may overflow */
        uint64_t high = digits_value(q, 8) * POW10[8] + digits_value(q + 8, 8);
        *overflow |= __builtin_mul_overflow(high, POW10[L - 16], &v);
        *overflow |= __builtin_add_overflow(v, digits_value(q + 16, L - 16), &v);
    }
    return v;
}

/* The integers of the `len` bytes at p (the inside of an array) from their bitmaps
 * (classify).  Each number's start and length are bit scans, independent of its
 * value, so one number's multiplies overlap the next one's (parse_to_bracket waits
 * for each number's length before the next can start).  The checks are a few word
 * operations per 64 bytes, not per number: numbers and commas must alternate,
 * number first and last (a running parity of the two kinds of bits puts every
 * number at an odd place and every comma at an even one), and no number of two
 * digits or more starts with '0'.  `end` is the buffer's end (digits are read 8
 * bytes at a time where it allows).  1 when all parsed, 0 when the array is not
 * plain integers in range.  Writes at most (len + 1) / 2 values, as uint32 with
 * `u32` (token ids: 0 when one is over 2**32 - 1). */
static int parse_classified(const uint8_t *p, Py_ssize_t len, const uint8_t *end,
                            const uint64_t *digits, const uint64_t *commas,
                            const uint64_t *zeros, int u32, uint64_t *vals,
                            Py_ssize_t *count) {
    Py_ssize_t words = (len + 63) / 64, n = 0;
    uint32_t *narrow = (uint32_t *)vals;  /* item n of 4 bytes never passes item n of 8 */
    uint64_t high = 0;                    /* any bit over 32 of a token id */
    Py_ssize_t safe = end - p - 24;  /* a number starting before this has 24 bytes */
    uint64_t run_in = 0, parity = 0;
    for (Py_ssize_t w = 0; w < words; w++) {
        uint64_t d = digits[w], next = w + 1 < words ? digits[w + 1] : 0;
        uint64_t starts = d & ~((d << 1) | run_in);
        run_in = d >> 63;
        uint64_t events = starts | commas[w];
        uint64_t odd = prefix_xor(events) ^ (0 - parity);
        if ((starts & ~odd) | (commas[w] & odd)) return 0;
        parity = odd >> 63;
        if (starts & zeros[w] & ((d >> 1) | (next << 63))) return 0;  /* "01" */
        while (starts) {
            int b = __builtin_ctzll(starts);
            starts &= starts - 1;
            /* the digits from bit b on, the next word's after them (none when b is 0) */
            uint64_t run = (d >> b) | ((next << 1) << (63 - b));
            int L = __builtin_ctzll(~run | (uint64_t)1 << 63);
            Py_ssize_t s = 64 * w + b;
            uint64_t v;
            if (L <= 8 && s < safe) {
                v = digits_value(p + s, L);
            } else {
                int overflow = L > 20;
                v = overflow ? 0 : long_digits(p + s, L, s < safe, &overflow);
                if (overflow) return 0;
            }
            if (u32) {
                high |= v >> 32;
                narrow[n++] = (uint32_t)v;
            } else {
                vals[n++] = v;
            }
        }
    }
    /* a comma last, commas and no number, or a token id over 2**32 - 1 */
    if (parity != (n > 0) || high) return 0;
    *count = n;
    return 1;
}

PyObject *sarp_u64_array(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    sarp_calls[CALL_U64_ARRAY]++;
    if (nargs != 3 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "u64_array(body, start, end[, u32])");
        return NULL;
    }
    int u32 = nargs == 4 ? PyObject_IsTrue(args[3]) : 0;
    if (u32 < 0) return NULL;
    Py_ssize_t start = PyLong_AsSsize_t(args[1]), end = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *out = NULL;
    if (start < 0 || end > b.len || start > end) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "start and end must bound a slice of body");
        return NULL;
    }
    const uint8_t *p = (const uint8_t *)b.buf + start, *stop = (const uint8_t *)b.buf + end;
    /* at most one number per two bytes ("1," ...), plus one */
    Py_ssize_t cap = (end - start) / 2 + 1, n = 0;
    uint64_t *vals = PyMem_Malloc((size_t)cap * sizeof(uint64_t));
    if (vals == NULL) {
        PyBuffer_Release(&b);
        return PyErr_NoMemory();
    }
    int ok = 1, narrowed = 0;
    /* the bitmaps of a slice of up to 4 KiB on the stack, of a longer one on the heap */
    Py_ssize_t words = (end - start + 63) / 64;
    uint64_t small[3 * 64], *maps = words <= 64 ? small
                                                : PyMem_Malloc(3 * (size_t)words * 8);
    if (maps == NULL) {
        PyMem_Free(vals);
        PyBuffer_Release(&b);
        return PyErr_NoMemory();
    }
    /* a long array is read without the GIL (an agentic query's 25,000 ids take about
     * 0.1 ms), so that the worker's event loop reads and answers meanwhile */
    int classified, release = end - start >= GIL_FREE_BYTES;
    PyThreadState *state = release ? PyEval_SaveThread() : NULL;
    classified = classify(p, end - start, maps, maps + words, maps + 2 * words);
    if (classified)
        ok = parse_classified(p, end - start, (const uint8_t *)b.buf + b.len, maps,
                              maps + words, maps + 2 * words, u32, vals, &n);
    if (release) PyEval_RestoreThread(state);
    if (classified) {
        narrowed = 1;
        p = stop;  /* decided: the loops below have nothing left to do */
    }
    if (maps != small) PyMem_Free(maps);
    if (p < stop && end < b.len && *stop == ']') {
        ok = parse_to_bracket(p, stop, (const uint8_t *)b.buf + b.len, vals, cap, &n);
        p = stop;  /* the checked loop below has nothing left to do */
    }
    while (p < stop && is_ws(*p)) p++;
    if (p < stop) {
        for (;;) {
            int negative = 0;
            if (p < stop && *p == '-') { negative = 1; p++; }
            if (p >= stop || *p < '0' || *p > '9') { ok = 0; break; }
            const uint8_t *digits = p;
            uint64_t v = 0;
            int overflow = 0;
            while (p < stop && *p >= '0' && *p <= '9') {
                /* no division per digit: up to 19 digits cannot overflow, so only
                 * the longer ones are checked (a divide is the cost of ten digits) */
                uint64_t d = (uint64_t)(*p - '0');
                if (p - digits < 19) {
                    v = v * 10 + d;
                } else {
                    overflow |= __builtin_mul_overflow(v, (uint64_t)10, &v);
                    overflow |= __builtin_add_overflow(v, d, &v);
                }
                p++;
            }
            if (overflow || (p - digits > 1 && digits[0] == '0')) { ok = 0; break; }
            if (negative) {
                if (v > (uint64_t)1 << 63) { ok = 0; break; }
                v = (uint64_t)0 - v;
            }
            if (n == cap) { ok = 0; break; }
            vals[n++] = v;
            while (p < stop && is_ws(*p)) p++;
            if (p == stop) break;
            if (*p != ',') { ok = 0; break; }
            p++;
            while (p < stop && is_ws(*p)) p++;
        }
    }
    if (ok) {
        if (u32 && !narrowed) {  /* in place: item i of 4 bytes never passes item i of 8 */
            for (Py_ssize_t i = 0; i < n && ok; i++) {
                ok = vals[i] <= 0xFFFFFFFFu;
                uint32_t narrow = (uint32_t)vals[i];
                memcpy((char *)vals + 4 * i, &narrow, 4);
            }
        }
        out = ok ? PyBytes_FromStringAndSize((const char *)vals, n * (u32 ? 4 : 8))
                 : Py_NewRef(Py_None);
    } else {
        out = Py_NewRef(Py_None);
    }
    PyMem_Free(vals);
    PyBuffer_Release(&b);
    return out;
}

