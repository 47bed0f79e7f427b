/* Read columns of one rowid table of an SQLite database file straight from its B-tree pages
 * (https://www.sqlite.org/fileformat.html, sections 1.6 and 2): integer columns into int64 arrays
 * and one text column into codes of its distinct values, with no SQL engine and no object per row.
 *
 * advisor/trace/nsys.py reads an Nsight Systems export with it: 47 M rows of a 3.7 GB export cost
 * SQLite's row stepping plus connectorx's frames 25 s of CPU; the pages parse in a few seconds.
 * Whatever this reader does not handle (an index-organised table, an integer column holding text,
 * a damaged page) it reports by a negative return, and the caller reads that table through SQLite,
 * which names the problem. It never writes past the capacity it was given. */

#define _GNU_SOURCE /* pread under -std=c11 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define SP_CAPACITY -2 /* more rows than the caller's capacity */
#define SP_FORMAT -3   /* not a page layout this reader takes (or a damaged one) */
#define SP_TYPE -4     /* a value of a type the caller did not ask for (text in an integer column...) */
#define SP_NOMEM -5
#define SP_IO -6

#define RUN_PAGES 256 /* consecutive leaf pages read with one pread */
#define MAX_DEPTH 64
#define MAX_COLS 256

typedef struct {
    uint64_t hash;
    int64_t off;
    int64_t len;
    int64_t code;
} slot_t;

/* The distinct texts met, in order of first appearance; codes index them. */
typedef struct {
    slot_t *slots;
    int64_t nslots; /* a power of two, at most half full */
    int64_t n;
    char *arena;
    int64_t arena_len, arena_cap;
    int64_t *offsets; /* offsets[i]: where text i starts in the arena; offsets[n] = arena_len */
    int64_t offsets_cap;
} sp_dict;

typedef struct {
    int fd;
    int64_t page_size, usable, npages;
    uint8_t *run;     /* RUN_PAGES pages */
    uint8_t *page;    /* one page, for interior and overflow pages */
    uint8_t *payload; /* a record spilled to overflow pages, put back together */
    int64_t payload_cap;
    int64_t visited; /* pages visited: more than the file has means a loop */
} reader_t;

static int64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    if (n < 8 && (p[0] & 0x80)) v |= ~(uint64_t)0 << (8 * n); /* two's complement of n bytes */
    return (int64_t)v;
}

static int varint(const uint8_t *p, const uint8_t *end, uint64_t *v) {
    uint64_t x = 0;
    for (int i = 0; i < 8; i++) {
        if (p + i >= end) return 0;
        x = (x << 7) | (p[i] & 0x7f);
        if (!(p[i] & 0x80)) {
            *v = x;
            return i + 1;
        }
    }
    if (p + 8 >= end) return 0;
    *v = (x << 8) | p[8];
    return 9;
}

static int read_pages(reader_t *r, uint8_t *buf, int64_t first, int64_t count) {
    if (first < 1 || first + count - 1 > r->npages) return SP_FORMAT;
    int64_t want = count * r->page_size, off = (first - 1) * r->page_size, got = 0;
    while (got < want) {
        ssize_t k = pread(r->fd, buf + got, (size_t)(want - got), (off_t)(off + got));
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return k == 0 ? SP_FORMAT : SP_IO;
        got += k;
    }
    return 0;
}

static int push_leaf(reader_t *r, int64_t page, int64_t **leaves, int64_t *n, int64_t *cap) {
    if (++r->visited > r->npages) return SP_FORMAT;
    if (*n == *cap) {
        int64_t c = *cap ? 2 * *cap : 1024;
        int64_t *grown = realloc(*leaves, (size_t)c * sizeof **leaves);
        if (!grown) return SP_NOMEM;
        *leaves = grown, *cap = c;
    }
    (*leaves)[(*n)++] = page;
    return 0;
}

/* Which of a file's pages the page cache held at one moment: one byte per OS page (mincore). */
typedef struct {
    int64_t os_page, os_pages;
    unsigned char *vec;
} sp_cached;

/* The page cache's hold on the file at `path` now; NULL where that cannot be known (then nothing
 * is dropped). */
sp_cached *sp_cached_new(const char *path) {
#ifndef POSIX_FADV_DONTNEED /* macOS: no posix_fadvise, so nothing could be dropped */
    (void)path;
    return NULL;
#endif
    long os_page = sysconf(_SC_PAGESIZE);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return NULL;
    off_t size = lseek(fd, 0, SEEK_END);
    sp_cached *c = os_page > 0 && size > 0 ? calloc(1, sizeof *c) : NULL;
    void *map = c ? mmap(NULL, (size_t)size, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
    if (map != MAP_FAILED) {
        c->os_page = os_page, c->os_pages = ((int64_t)size + os_page - 1) / os_page;
        c->vec = malloc((size_t)c->os_pages);
        if (c->vec && mincore(map, (size_t)size, (void *)c->vec) != 0) {
            free(c->vec);
            c->vec = NULL;
        }
        munmap(map, (size_t)size);
    }
    close(fd);
    if (c && !c->vec) {
        free(c);
        c = NULL;
    }
    return c;
}

void sp_cached_free(sp_cached *c) {
    if (!c) return;
    free(c->vec);
    free(c);
}

/* Hand back to the kernel the pages of bytes [off, off + len) of the file open as `fd` that were not
 * in the page cache when `c` was taken, keeping those that were: a multi-GB export read once does not
 * push the machine's cached files out, and on a VM whose host backs guest memory on demand the page
 * cache's pages go on to hold the event table instead of the host backing both
 * (bench/results/analyze_speed.md). A file that was cached stays cached. */
static void drop_read(const sp_cached *c, int fd, int64_t off, int64_t len) {
    if (!c || len <= 0) return;
    int64_t first = off / c->os_page, last = (off + len - 1) / c->os_page;
    if (last >= c->os_pages) last = c->os_pages - 1;
    for (int64_t p = first; p <= last;) {
        if (c->vec[p] & 1) {
            p++;
            continue;
        }
        int64_t q = p;
        while (q < last && !(c->vec[q + 1] & 1)) q++;
#ifdef POSIX_FADV_DONTNEED
        posix_fadvise(fd, (off_t)(p * c->os_page), (off_t)((q - p + 1) * c->os_page), POSIX_FADV_DONTNEED);
#endif
        p = q + 1;
    }
}

/* Everything of the file at `path` that was not cached when `c` was taken, handed back: what the
 * kernel's read-ahead brought in beside the pages each read dropped (tables' pages interleave). */
void sp_cached_drop(const sp_cached *c, const char *path) {
    if (!c) return;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    drop_read(c, fd, 0, c->os_pages * c->os_page);
    close(fd);
}

/* Leaf pages of the B-tree under `page`, left to right (rowid order), appended to *leaves. SQLite's
 * B-trees are balanced (all leaves at one depth), so once an interior page's first child is a leaf,
 * its other children are taken as leaves unread: sp_read checks each leaf's type when it parses it,
 * and this walk reads one page in a few hundred instead of every leaf twice. */
static int collect(reader_t *r, int64_t page, int depth, int64_t **leaves, int64_t *n, int64_t *cap) {
    if (depth > MAX_DEPTH || r->visited >= r->npages) return SP_FORMAT;
    uint8_t *buf = malloc((size_t)r->page_size);
    if (!buf) return SP_NOMEM;
    int rc = read_pages(r, buf, page, 1);
    const uint8_t *h = buf + (page == 1 ? 100 : 0);
    if (rc == 0 && h[0] == 0x0D) { /* a leaf */
        rc = push_leaf(r, page, leaves, n, cap);
    } else if (rc == 0 && h[0] == 0x05) { /* interior: a child per cell, then the right-most */
        ++r->visited;
        int64_t cells = be(h + 3, 2) & 0xFFFF;
        int leaf_children = 0;
        if (12 + 2 * cells > r->usable - (h - buf)) rc = SP_FORMAT;
        for (int64_t i = 0; rc == 0 && i <= cells; i++) {
            int64_t child;
            if (i < cells) {
                int64_t at = be(h + 12 + 2 * i, 2) & 0xFFFF;
                if (at + 4 > r->usable) {
                    rc = SP_FORMAT;
                    break;
                }
                child = be(buf + at, 4) & 0xFFFFFFFF;
            } else {
                child = be(h + 8, 4) & 0xFFFFFFFF;
            }
            if (child < 1 || child > r->npages) {
                rc = SP_FORMAT;
                break;
            }
            if (leaf_children) {
                rc = push_leaf(r, child, leaves, n, cap);
                continue;
            }
            int64_t before = *n;
            rc = collect(r, child, depth + 1, leaves, n, cap);
            leaf_children = rc == 0 && *n == before + 1 && (*leaves)[before] == child;
        }
    } else if (rc == 0) {
        rc = SP_FORMAT; /* an index B-tree (WITHOUT ROWID) or not a B-tree page */
    }
    free(buf);
    return rc;
}

/* The record of the cell at `cell` (its payload after the rowid): in place, or put back together
 * from its overflow pages into r->payload. */
static int payload(reader_t *r, const uint8_t *page, const uint8_t *cell, uint64_t size, const uint8_t **out) {
    const uint8_t *end = page + r->usable;
    int64_t u = r->usable, x = u - 35;
    if ((int64_t)size <= x) {
        if (cell + size > end) return SP_FORMAT;
        *out = cell;
        return 0;
    }
    int64_t m = ((u - 12) * 32 / 255) - 23, k = m + (((int64_t)size - m) % (u - 4));
    int64_t local = k <= x ? k : m;
    if (cell + local + 4 > end || size > (uint64_t)r->npages * (uint64_t)u) return SP_FORMAT;
    if ((int64_t)size > r->payload_cap) {
        uint8_t *grown = realloc(r->payload, (size_t)size);
        if (!grown) return SP_NOMEM;
        r->payload = grown, r->payload_cap = (int64_t)size;
    }
    memcpy(r->payload, cell, (size_t)local);
    int64_t have = local, next = be(cell + local, 4) & 0xFFFFFFFF, hops = 0;
    while (have < (int64_t)size) {
        if (next == 0 || ++hops > r->npages) return SP_FORMAT;
        int rc = read_pages(r, r->page, next, 1);
        if (rc) return rc;
        int64_t take = (int64_t)size - have < u - 4 ? (int64_t)size - have : u - 4;
        memcpy(r->payload + have, r->page + 4, (size_t)take);
        have += take;
        next = be(r->page, 4) & 0xFFFFFFFF;
    }
    *out = r->payload;
    return 0;
}

/* A hash of the text for the dictionary's table: eight bytes a step (a byte-at-a-time hash cost a
 * fifth of the NVTX read, 28 M texts at 3.7 GB); the codes do not depend on it. */
static uint64_t text_hash(const uint8_t *p, int64_t n) {
    const uint64_t k = 0x9E3779B97F4A7C15ULL;
    uint64_t h = (uint64_t)n * k, w;
    for (; n >= 8; p += 8, n -= 8) {
        memcpy(&w, p, 8);
        h = (h ^ w) * k;
        h ^= h >> 29;
    }
    w = 0;
    memcpy(&w, p, (size_t)n);
    h = (h ^ w) * k;
    return h ^ (h >> 32);
}

static int dict_grow(sp_dict *d) {
    int64_t ns = d->nslots ? 2 * d->nslots : 1 << 12;
    slot_t *slots = calloc((size_t)ns, sizeof *slots); /* code 0: an empty slot */
    if (!slots) return SP_NOMEM;
    for (int64_t i = 0; i < d->nslots; i++) {
        if (!d->slots[i].code) continue;
        int64_t j = (int64_t)(d->slots[i].hash & (uint64_t)(ns - 1));
        while (slots[j].code) j = (j + 1) & (ns - 1);
        slots[j] = d->slots[i];
    }
    free(d->slots);
    d->slots = slots, d->nslots = ns;
    return 0;
}

/* The code of text p[0:n] (0-based, first appearance order); negative on failure. */
static int64_t dict_code(sp_dict *d, const uint8_t *p, int64_t n) {
    if (2 * (d->n + 1) > d->nslots && dict_grow(d)) return SP_NOMEM;
    uint64_t h = text_hash(p, n);
    int64_t j = (int64_t)(h & (uint64_t)(d->nslots - 1));
    while (d->slots[j].code) { /* codes are kept + 1 */
        slot_t *s = &d->slots[j];
        if (s->hash == h && s->len == n && memcmp(d->arena + s->off, p, (size_t)n) == 0) return s->code - 1;
        j = (j + 1) & (d->nslots - 1);
    }
    if (d->arena_len + n > d->arena_cap) {
        int64_t c = d->arena_cap ? 2 * d->arena_cap : 1 << 16;
        while (c < d->arena_len + n) c *= 2;
        char *grown = realloc(d->arena, (size_t)c);
        if (!grown) return SP_NOMEM;
        d->arena = grown, d->arena_cap = c;
    }
    if (d->n + 2 > d->offsets_cap) {
        int64_t c = d->offsets_cap ? 2 * d->offsets_cap : 1 << 12;
        int64_t *grown = realloc(d->offsets, (size_t)c * sizeof *grown);
        if (!grown) return SP_NOMEM;
        d->offsets = grown, d->offsets_cap = c;
    }
    memcpy(d->arena + d->arena_len, p, (size_t)n);
    d->offsets[d->n] = d->arena_len;
    d->slots[j] = (slot_t){h, d->arena_len, n, d->n + 1};
    d->arena_len += n;
    d->offsets[++d->n] = d->arena_len;
    return d->n - 1;
}

/* The first `mark` (m >= 1 bytes) in p[0:n]: its first byte found with memchr, the rest compared
 * (glibc's memmem sets up for each call, which on 35-byte texts cost more than the search). */
static const uint8_t *find(const uint8_t *p, int64_t n, const char *mark, int64_t m) {
    const uint8_t *end = p + n;
    while (end - p >= m) {
        const uint8_t *c = memchr(p, mark[0], (size_t)(end - p - m + 1));
        if (!c) return NULL;
        if (memcmp(c + 1, mark + 1, (size_t)(m - 1)) == 0) return c;
        p = c + 1;
    }
    return NULL;
}

/* emit_nvtx's texts cut as advisor/trace/nsys.py's _NVTX_TEXT_SQL cuts them: a text holding
 * ", op_id = " and a digit ends just after its first ", seq = " (where that comes before its first
 * ", op_id = ") or its first ", op_id = "; any other text stays whole. */
static int64_t cut(const uint8_t *p, int64_t n) {
    static const char op[] = ", op_id = ", seq[] = ", seq = ";
    const int64_t lop = sizeof op - 1, lseq = sizeof seq - 1;
    const uint8_t *first = find(p, n, op, lop), *at = first;
    int digit = 0;
    while (at && !digit) {
        int64_t after = at - p + lop;
        digit = after < n && p[after] >= '0' && p[after] <= '9';
        if (!digit) at = find(at + 1, n - (at + 1 - p), op, lop);
    }
    if (!digit) return n;
    const uint8_t *s = find(p, first - p, seq, lseq);
    return s ? (s - p) + lseq : (first - p) + lop;
}

typedef struct {
    int type; /* serial type; -1: the record has no such column (NULL) */
    int64_t off;
} field_t;

static int int_value(const uint8_t *body, const field_t *f, int64_t *v) {
    static const int width[] = {0, 1, 2, 3, 4, 6, 8};
    if (f->type <= 0) return 1; /* NULL */
    if (f->type <= 6) *v = be(body + f->off, width[f->type]);
    else if (f->type == 8 || f->type == 9) *v = f->type - 8;
    else return SP_TYPE;
    return 0;
}

/* Reads columns `cols` (indexes into the record, -1 for the rowid) of the table whose B-tree root
 * is `root` into out[j][row] (int64, NULL read as nulls[j]), keeping the rows where column
 * `notnull` (-1: none) is not NULL and column `within` (-1: none) holds one of within_vals. Column
 * `text` (-1: none) is coded into codes[row] (-1 for NULL or empty), through *dict; `cut_ops`
 * applies cut() first. The leaf pages it reads that `cached` (NULL: none) says were not in the
 * page cache are dropped from it as soon as each run is in the reader's buffer. Returns the rows
 * kept, or a negative SP_* code. */
int64_t sp_read(const char *path, int64_t page_size, int64_t usable, int64_t npages, int64_t root, int ncols,
                const int *cols, const int64_t *nulls, int64_t **out, int64_t capacity, int text, int cut_ops,
                int64_t *codes, sp_dict *dict, int notnull, int within, const int64_t *within_vals, int nwithin,
                const sp_cached *cached) {
    reader_t r = {.page_size = page_size, .usable = usable, .npages = npages};
    int64_t *leaves = NULL, nleaves = 0, cap = 0, rows = 0;
    int last = text > notnull ? text : notnull, rc = 0;
    last = within > last ? within : last;
    for (int j = 0; j < ncols; j++) last = cols[j] > last ? cols[j] : last;
    if (page_size < 512 || usable < 480 || usable > page_size || last >= MAX_COLS) return SP_FORMAT;
    r.fd = open(path, O_RDONLY | O_CLOEXEC);
    if (r.fd < 0) return SP_IO;
    r.run = malloc((size_t)(page_size * RUN_PAGES));
    r.page = malloc((size_t)page_size);
    if (!r.run || !r.page) rc = SP_NOMEM;
    if (rc == 0) rc = collect(&r, root, 0, &leaves, &nleaves, &cap);
    field_t fields[MAX_COLS];
    for (int64_t i = 0; rc == 0 && i < nleaves;) {
        int64_t k = 1;
        while (i + k < nleaves && k < RUN_PAGES && leaves[i + k] == leaves[i] + k) k++;
        rc = read_pages(&r, r.run, leaves[i], k);
        if (rc == 0) drop_read(cached, r.fd, (leaves[i] - 1) * page_size, k * page_size);
        for (int64_t q = 0; rc == 0 && q < k; q++) {
            const uint8_t *page = r.run + q * page_size, *h = page + (leaves[i + q] == 1 ? 100 : 0);
            const uint8_t *end = page + usable;
            int64_t cells = be(h + 3, 2) & 0xFFFF;
            if (h[0] != 0x0D || h + 8 + 2 * cells > end) {
                rc = SP_FORMAT;
                break;
            }
            for (int64_t c = 0; c < cells; c++) {
                int64_t at = be(h + 8 + 2 * c, 2) & 0xFFFF;
                const uint8_t *cell = page + at, *rec;
                uint64_t size, rowid, hsize;
                int a, b, hb;
                if (at >= usable || !(a = varint(cell, end, &size)) || !(b = varint(cell + a, end, &rowid))) {
                    rc = SP_FORMAT;
                    break;
                }
                if ((rc = payload(&r, page, cell + a + b, size, &rec))) break;
                if (!(hb = varint(rec, rec + size, &hsize)) || hsize > size || hsize < (uint64_t)hb) {
                    rc = SP_FORMAT;
                    break;
                }
                /* serial types up to the last column read; the body offset of each */
                const uint8_t *t = rec + hb, *tend = rec + hsize;
                int64_t off = (int64_t)hsize;
                for (int f = 0; f <= last; f++) {
                    uint64_t st = 0;
                    int w = t < tend ? varint(t, tend, &st) : 0;
                    if (t < tend && !w) {
                        rc = SP_FORMAT;
                        break;
                    }
                    if (!w) { /* a record older than an added column: NULL (the caller checked no default) */
                        fields[f] = (field_t){-1, 0};
                        continue;
                    }
                    t += w;
                    if (st == 10 || st == 11 || st > 0x7FFFFFFF) {
                        rc = SP_FORMAT;
                        break;
                    }
                    fields[f] = (field_t){(int)st, off};
                    static const int64_t width[] = {0, 1, 2, 3, 4, 6, 8, 8, 0, 0};
                    off += st >= 12 ? (int64_t)(st - 12) / 2 : width[st];
                }
                if (rc) break;
                if (off > (int64_t)size) {
                    rc = SP_FORMAT;
                    break;
                }
                int64_t v;
                if (notnull >= 0 && fields[notnull].type <= 0) continue;
                if (within >= 0) {
                    int got = int_value(rec, &fields[within], &v);
                    if (got < 0) {
                        rc = got;
                        break;
                    }
                    int in = 0;
                    for (int w = 0; got == 0 && w < nwithin && !in; w++) in = within_vals[w] == v;
                    if (!in) continue;
                }
                if (rows >= capacity) {
                    rc = SP_CAPACITY;
                    break;
                }
                for (int j = 0; rc == 0 && j < ncols; j++) {
                    if (cols[j] < 0) {
                        out[j][rows] = (int64_t)rowid;
                        continue;
                    }
                    int got = int_value(rec, &fields[cols[j]], &v);
                    if (got < 0) rc = got;
                    out[j][rows] = got ? nulls[j] : v;
                }
                if (rc) break;
                if (text >= 0) {
                    const field_t *f = &fields[text];
                    if (f->type > 0 && f->type < 12) {
                        rc = SP_TYPE; /* a number in a text column: SQLite's CAST decides */
                        break;
                    }
                    int64_t n = f->type >= 12 ? (f->type - 12) / 2 : 0;
                    if (cut_ops && n) n = cut(rec + f->off, n);
                    codes[rows] = n ? dict_code(dict, rec + f->off, n) : -1;
                    if (codes[rows] < -1) {
                        rc = (int)codes[rows];
                        break;
                    }
                }
                rows++;
            }
        }
        i += k;
    }
    free(leaves);
    free(r.run);
    free(r.page);
    free(r.payload);
    close(r.fd);
    return rc ? rc : rows;
}

sp_dict *sp_dict_new(void) {
    sp_dict *d = calloc(1, sizeof *d);
    if (d && dict_grow(d)) {
        free(d);
        return NULL;
    }
    return d;
}

int64_t sp_dict_size(const sp_dict *d) { return d->n; }
int64_t sp_dict_bytes(const sp_dict *d) { return d->arena_len; }

/* The distinct texts: their bytes end to end into buf, and n + 1 offsets into offsets. */
void sp_dict_copy(const sp_dict *d, char *buf, int64_t *offsets) {
    if (d->arena_len) memcpy(buf, d->arena, (size_t)d->arena_len);
    offsets[0] = 0;
    if (d->n) memcpy(offsets, d->offsets, (size_t)(d->n + 1) * sizeof *offsets);
}

void sp_dict_free(sp_dict *d) {
    if (!d) return;
    free(d->slots);
    free(d->arena);
    free(d->offsets);
    free(d);
}
