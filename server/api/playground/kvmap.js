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

  // Reads one snapshot (kvcache/snapshot.py's shape); returns the counts and owners shown beside the map.
  update(snap) {
    const n = snap.num_blocks;
    this.snap = snap;
    this.n = n;
    this.state = new Uint8Array(n);
    this.owner = new Int32Array(n).fill(-1);
    this.blocks = new Map();
    this.keys = [];
    const keyIndex = new Map();
    const owners = new Map(); // key -> blocks held
    let shared = 0;
    if (n > 0) this.state[0] = NULL;
    for (const b of snap.blocks) {
      this.blocks.set(b.id, b);
      if (b.state === "cached") { this.state[b.id] = CACHED; continue; }
      this.state[b.id] = b.ref_count > 1 ? SHARED : USED;
      if (b.ref_count > 1) shared++;
      for (const o of b.owners) {
        const key = ownerKey(o);
        if (!keyIndex.has(key)) { keyIndex.set(key, this.keys.length); this.keys.push(key); }
        owners.set(key, (owners.get(key) || 0) + 1);
      }
      if (b.owners.length) this.owner[b.id] = keyIndex.get(ownerKey(b.owners[0]));
    }
    this.layout(n);
    this.draw();
    const ownerList = [...owners].map(([key, blocks]) => ({ key, blocks, colour: this.colourOf(key) }));
    return { used: snap.used_blocks, shared, cached: snap.cached_blocks, free: snap.free_blocks,
             per: this.per, owners: ownerList };
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
      const colour = owner >= 0 ? this.colourOf(this.keys[owner]) : "#cccccc";
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
      const b = this.blocks.get(lo);
      const bs = this.snap.block_size;
      if (!b) return `block ${lo}\n${STATE_NAMES[this.state[lo]]}\nref count 0 · 0/${bs} tokens`;
      const who = b.owners.map((o) => `  ${ownerKey(o)} (seq ${o.seq_id})`).join("\n");
      return `block ${b.id}\n${STATE_NAMES[this.state[lo]]}\nref count ${b.ref_count} · ${b.tokens}/${bs} tokens` +
        (who ? `\nowners:\n${who}` : "");
    }
    const { counts } = this.cellStyle(lo, hi);
    const owners = new Set();
    for (let b = lo; b < hi; b++) if (this.owner[b] >= 0) owners.add(this.keys[this.owner[b]]);
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
    this.tip.style.left = `${Math.min(x + 14, r.width - 180)}px`;
    this.tip.style.top = `${y + 14}px`;
    this.tip.hidden = false;
  }
}
