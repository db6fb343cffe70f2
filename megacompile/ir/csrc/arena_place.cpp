// Greedy offset placement over known lifetimes: ir/arena.py place(), the same offsets, in C++.
//
// The tensors are placed one by one in the given order. Each meets the tensors placed before it
// whose lifetimes [first, last] intersect its own; among those, sorted by offset, it goes into
// the tightest gap that holds it (or the lowest), else above the highest of them.
//
// What makes it fast is finding the tensors a lifetime meets without looking at all placed
// before it. A step's schedule has ~10^5 device tensors, most alive for a few steps, some
// (saved activations, stashes) for most of the step. Placed tensors go into one of a few levels
// by lifetime: level j holds lifetimes of at most kBase * 8^j steps, in buckets of that many
// steps, so each tensor sits in at most two buckets of its level. A query looks at the buckets its
// own lifetime covers in every level and keeps what truly meets it, each tensor once.
#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBase = 1024;    // steps per bucket of the first level
constexpr int kGrowth = 3;        // each level's buckets are 2**kGrowth times wider

struct Placed {
    int64_t first, last, low, high;
    int64_t bucket;               // the lower of its (at most two) buckets
};

struct Level {
    int64_t width;
    std::vector<std::vector<Placed>> buckets;    // each in order of offset
};

// The tensors of one bucket that meet the query, in order of offset: those from `at` on that
// meet it in time and that the query does not take from the bucket below (a tensor in two
// buckets, both in the query's range, is taken from the lower one only).
struct Cursor {
    const Placed* at;
    const Placed* end;
    int64_t bucket;
    bool first_bucket;            // the lowest bucket of the query's range at this level

    bool meets(int64_t f, int64_t l) const {
        return at->first <= l && at->last >= f && (first_bucket || at->bucket == bucket);
    }
    bool next(int64_t f, int64_t l) {     // to the next tensor that meets; false past the end
        while (at != end && !meets(f, l)) ++at;
        return at != end;
    }
};

struct Later {                    // heap order: the lowest offset on top
    bool operator()(const Cursor& a, const Cursor& b) const { return a.at->low > b.at->low; }
};

}  // namespace

extern "C" void megacompile_arena_place(int64_t count, const int64_t* order, const int64_t* sizes,
                                        const int64_t* firsts, const int64_t* lasts, int tightest,
                                        int64_t* offsets) {
    int64_t steps = 1;
    for (int64_t k = 0; k < count; ++k) steps = std::max(steps, lasts[order[k]] + 1);
    std::vector<Level> levels;
    for (int64_t width = kBase;; width <<= kGrowth) {
        levels.push_back(Level{width, std::vector<std::vector<Placed>>((steps + width - 1) / width)});
        if (width >= steps) break;
    }
    std::vector<Cursor> heap;
    for (int64_t k = 0; k < count; ++k) {
        const int64_t i = order[k], size = sizes[i], f = firsts[i], l = lasts[i];
        heap.clear();
        for (const Level& level : levels) {
            const int64_t q1 = f / level.width, q2 = l / level.width;
            for (int64_t b = q1; b <= q2; ++b) {
                const std::vector<Placed>& bucket = level.buckets[b];
                Cursor c{bucket.data(), bucket.data() + bucket.size(), b, b == q1};
                if (c.next(f, l)) heap.push_back(c);
            }
        }
        std::make_heap(heap.begin(), heap.end(), Later());
        // The met tensors in order of offset (equal offsets in any order: after the first of them
        // every gap is negative), with `reach` the highest end below the next one.
        int64_t offset = 0, reach = 0, best_gap = INT64_MAX;
        bool found = false;
        while (!heap.empty()) {
            std::pop_heap(heap.begin(), heap.end(), Later());
            Cursor& c = heap.back();
            const int64_t gap = c.at->low - reach;
            if (gap >= size && gap < best_gap) {
                offset = reach;
                best_gap = gap;
                found = true;
                // The lowest gap that holds it, or one it fills exactly: no later gap is better.
                if (!tightest || gap == size) break;
            }
            reach = std::max(reach, c.at->high);
            ++c.at;
            if (c.next(f, l)) std::push_heap(heap.begin(), heap.end(), Later());
            else heap.pop_back();
        }
        if (!found) offset = reach;
        offsets[i] = offset;
        size_t j = 0;
        while (levels[j].width < l - f + 1) ++j;
        Level& level = levels[j];
        const int64_t lo = f / level.width, hi = l / level.width;
        const Placed placed{f, l, offset, offset + size, lo};
        for (int64_t b = lo; b <= hi; ++b) {
            std::vector<Placed>& bucket = level.buckets[b];
            auto at = std::upper_bound(bucket.begin(), bucket.end(), placed.low,
                                       [](int64_t low, const Placed& p) { return low < p.low; });
            bucket.insert(at, placed);
        }
    }
}
