// The KV block map on a canvas: one cell per physical block, or per run of `per` blocks when the cache has
// more blocks than the canvas has room for (a GPU cache holds hundreds of thousands).

export const FREE = 0, CACHED = 1, USED = 2, SHARED = 3, NULL = 4;
export const COLOURS = { free: "#262c37", cached: "#596a80", shared: "#f2c14e", null: "#000000" };
const CELL_SIZES = [14, 11, 9, 7, 5, 4, 3]; // px, largest first: the biggest cells that fit MAX_HEIGHT
const MAX_HEIGHT = 420;
const STATE_NAMES = ["free", "cached-free", "used", "shared", "null (padding)"];

export function ownerKey(o) {
  return o.request_id !== undefined ? `${o.request_id}#${o.index ?? 0}` : `seq ${o.seq_id}`;
}

export class KVMap {
  constructor(canvas, tip) {
    this.canvas = canvas;
    this.tip = tip;
    this.ctx = canvas.getContext("2d");
    this.hues = new Map(); // owner key -> hue, kept across updates so a sequence keeps its colour
    this.n = 0;
    canvas.addEventListener("mousemove", (e) => this.hover(e));
    canvas.addEventListener("mouseleave", () => { this.tip.hidden = true; });
  }

  colourOf(key) {
    if (!this.hues.has(key)) {
      // golden-angle steps spread consecutive owners around the wheel; skip the shared gold (35-60 deg)
      let hue = (this.hues.size * 137.508 + 200) % 360;
      if (hue > 35 && hue < 60) hue += 30;
      this.hues.set(key, hue);
    }
    return `hsl(${this.hues.get(key).toFixed(1)}, 68%, 58%)`;
  }

  // Reads one map (kvcache/snapshot.py's shape: block tables as runs); returns what the page shows beside it.
  update(snap) {
    const n = snap.num_blocks, bs = snap.block_size;
    this.snap = snap;
    this.n = n;
    this.state = new Uint8Array(n);
    this.ref = new Uint16Array(n);
    this.tokens = new Uint16Array(n);
    this.owner = new Int32Array(n).fill(-1); // index in snap.seqs of the block's first holder
    this.seqColours = snap.seqs.map((seq) => this.colourOf(ownerKey(seq)));
    const owners = snap.seqs.map((seq, k) => {
      let pos = 0;
      for (const [first, count] of seq.blocks) {
        for (let b = first; b < first + count; b++, pos++) {
          this.ref[b]++;
          if (this.owner[b] < 0) this.owner[b] = k;
          this.tokens[b] = Math.max(this.tokens[b], Math.min(bs, seq.num_tokens - pos * bs));
        }
      }
      return { key: ownerKey(seq), blocks: pos, colour: this.seqColours[k] };
    });
    let shared = 0;
    for (let b = 0; b < n; b++) {
      if (this.ref[b] > 1) { this.state[b] = SHARED; shared++; } else if (this.ref[b]) this.state[b] = USED;
    }
    for (const [first, count] of snap.cached) {
      for (let b = first; b < first + count; b++) { this.state[b] = CACHED; this.tokens[b] = bs; }
    }
    if (n > 0) this.state[0] = NULL;
    this.layout(n);
    this.draw();
    return { used: snap.used_blocks, shared, cached: snap.cached_blocks, free: snap.free_blocks,
             per: this.per, owners };
  }

  // Block ids in one state ("used" = ref count 1, "shared", "cached", "free"), ascending.
  idsIn(name) {
    const want = { free: FREE, cached: CACHED, used: USED, shared: SHARED }[name];
    const ids = [];
    for (let b = 0; b < this.n; b++) if (this.state[b] === want) ids.push(b);
    return ids;
  }

  holders(b) {
    return this.snap.seqs.filter((seq) => seq.blocks.some(([first, count]) => b >= first && b < first + count));
  }

  layout(n) {
    const width = this.canvas.width;
    this.per = 1;
    this.cell = CELL_SIZES[CELL_SIZES.length - 1];
    for (const cs of CELL_SIZES) {
      if (Math.ceil(n / Math.floor(width / cs)) * cs <= MAX_HEIGHT) { this.cell = cs; break; }
    }
    this.cols = Math.floor(width / this.cell);
    if (Math.ceil(n / this.cols) * this.cell > MAX_HEIGHT) {
      this.per = Math.ceil(n / (this.cols * Math.floor(MAX_HEIGHT / this.cell)));
    }
    this.cells = Math.ceil(n / this.per);
    const height = Math.max(this.cell, Math.ceil(this.cells / this.cols) * this.cell);
    if (this.canvas.height !== height) this.canvas.height = height;
  }

  // One cell's look: its blocks' states counted; shared wins, then used (the first owner's colour, fainter
  // the fewer of the cell's blocks are used), then cached, then free.
  cellStyle(lo, hi) {
    const counts = [0, 0, 0, 0, 0];
    let owner = -1;
    for (let b = lo; b < hi; b++) {
      counts[this.state[b]]++;
      if (owner < 0 && this.owner[b] >= 0) owner = this.owner[b];
    }
    const size = hi - lo;
    if (counts[SHARED]) return { colour: COLOURS.shared, alpha: 1, counts };
    if (counts[USED]) {
      const colour = owner >= 0 ? this.seqColours[owner] : "#cccccc";
      return { colour, alpha: 0.4 + 0.6 * counts[USED] / size, counts };
    }
    if (counts[CACHED]) return { colour: COLOURS.cached, alpha: 0.5 + 0.5 * counts[CACHED] / size, counts };
    if (counts[NULL] === size) return { colour: COLOURS.null, alpha: 1, counts };
    return { colour: COLOURS.free, alpha: 1, counts };
  }

  draw() {
    const { ctx, cell, cols, per } = this;
    const gap = cell >= 5 ? 1 : 0;
    ctx.clearRect(0, 0, this.canvas.width, this.canvas.height);
    for (let c = 0; c < this.cells; c++) {
      const x = (c % cols) * cell, y = Math.floor(c / cols) * cell;
      const { colour, alpha } = this.cellStyle(c * per, Math.min(this.n, (c + 1) * per));
      if (alpha < 1) {
        ctx.globalAlpha = 1;
        ctx.fillStyle = COLOURS.free;
        ctx.fillRect(x, y, cell - gap, cell - gap);
      }
      ctx.globalAlpha = alpha;
      ctx.fillStyle = colour;
      ctx.fillRect(x, y, cell - gap, cell - gap);
    }
    ctx.globalAlpha = 1;
  }

  // Centre of the cell holding block `id`, in canvas pixels (the canvas is drawn at its own size).
  cellCentre(id) {
    const c = Math.floor(id / this.per);
    return { x: (c % this.cols) * this.cell + this.cell / 2, y: Math.floor(c / this.cols) * this.cell + this.cell / 2 };
  }

  describe(c) {
    const lo = c * this.per, hi = Math.min(this.n, (c + 1) * this.per);
    if (this.per === 1) {
      const who = this.holders(lo).map((seq) => `  ${ownerKey(seq)} (seq ${seq.seq_id})`).join("\n");
      return `block ${lo}\n${STATE_NAMES[this.state[lo]]}\nref count ${this.ref[lo]} · ` +
        `${this.tokens[lo]}/${this.snap.block_size} tokens` + (who ? `\nowners:\n${who}` : "");
    }
    const { counts } = this.cellStyle(lo, hi);
    const owners = new Set();
    for (let b = lo; b < hi; b++) if (this.owner[b] >= 0) owners.add(ownerKey(this.snap.seqs[this.owner[b]]));
    return `blocks ${lo}–${hi - 1} (1 cell = ${this.per} blocks)\n${counts[USED]} used · ${counts[SHARED]} shared · ` +
      `${counts[CACHED]} cached-free · ${counts[FREE]} free` + (owners.size ? `\nowners: ${[...owners].join(", ")}` : "");
  }

  hover(e) {
    if (!this.n) return;
    const r = this.canvas.getBoundingClientRect();
    const x = e.clientX - r.left, y = e.clientY - r.top;
    const c = Math.floor(y / this.cell) * this.cols + Math.floor(x / this.cell);
    if (x < 0 || x >= this.cols * this.cell || c >= this.cells) { this.tip.hidden = true; return; }
    this.tip.textContent = this.describe(c);
    this.tip.hidden = false;
    const w = this.tip.offsetWidth; // beside the cursor, on the side where it fits
    this.tip.style.left = `${x + 14 + w <= r.width ? x + 14 : Math.max(0, x - 14 - w)}px`;
    this.tip.style.top = `${y + 14}px`;
  }
}
