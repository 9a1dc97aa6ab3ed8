// The trinity-train dashboard page. Live, it reads the server's JSON API (docs/CONTRACT.md
// "Dashboard") and redraws when the server pushes an update over Server-Sent Events; in the
// offline report, window.TRINITY_SNAPSHOT holds the same payloads and nothing is fetched.
// The panels come from the server's registry (trinity_train/dashboard/panels.py): for each, the
// page loads its payload with every run and calls the method of `draw` the panel names.
(function () {
  "use strict";

  const SNAPSHOT = window.TRINITY_SNAPSHOT || null;
  const COLORS = ["#0969da", "#cf222e", "#1a7f37", "#8250df", "#bf8700", "#1b7c83", "#e85aad", "#6e7781", "#953800", "#116329"];
  const TIME_PLOTS = ["plot-loss", "plot-grad-norm", "plot-lr", "plot-throughput", "plot-moe-heat", "plot-moe-lines", "plot-ranks"];
  const LAYER_PLOTS = ["plot-experts", "plot-depth-grad", "plot-depth-rms"];
  const DASHES = ["solid", "dash", "dot", "dashdot", "longdash", "longdashdot"];
  const CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["lasso2d", "select2d"] };

  const state = {
    runs: [],            // summaries from the server (or the snapshot)
    hidden: new Set(),   // run indices switched off in the run legend
    focus: 0,            // the run the heatmaps show
    range: null,         // [x0, x1] the time plots are zoomed to, null = everything
    layerIter: null,     // iteration the layer plots show, null = the latest
    panels: [],          // the registry's panels: {name, query, draw, slot}
    data: {},            // per run: panel name -> its payload
    rendered: false,
  };

  // ---- where the data comes from ---------------------------------------------------------

  function liveSource() {
    async function get(path, params) {
      const query = new URLSearchParams();
      for (const [k, v] of Object.entries(params || {})) if (v !== null && v !== undefined) query.set(k, v);
      const response = await fetch(`api/${path}${query.toString() ? "?" + query : ""}`);
      const body = await response.json();
      if (!response.ok) throw new Error(body.error || response.statusText);
      return body;
    }
    return {
      live: true,
      runs: () => get("runs").then((r) => r.runs),
      panels: () => get("panels").then((r) => r.panels),
      // the zoomed range only to the panels that read it
      panel: (run, panel, range) => get(`runs/${run}/${panel.name}`, panel.query.includes("range") ? range : {}),
      layerRecord: (run, iter) => get(`runs/${run}/layers`, { iter }),
      incident: (run, name) => get(`runs/${run}/incidents/${encodeURIComponent(name)}`),
    };
  }

  function snapshotSource(snapshot) {
    const of = (run) => snapshot.runs_data[run];
    return {
      live: false,
      runs: async () => snapshot.runs,
      panels: async () => snapshot.panels,
      panel: async (run, panel) => of(run)[panel.name],
      layerRecord: async (run, iter) => {
        const records = of(run).layer_records;
        let best = records.length ? records[records.length - 1] : { iter: null };
        if (iter !== null) for (const r of records) if (r.iter <= iter) best = r;
        return best;
      },
      incident: async (run, name) => {
        const report = of(run).incidents[name];
        if (!report) throw new Error("this incident report is not in the report file");
        return report;
      },
    };
  }

  const source = SNAPSHOT ? snapshotSource(SNAPSHOT) : liveSource();

  // ---- helpers ---------------------------------------------------------------------------

  // The panels' draw functions, by the name a panel of the registry gives as its `draw`.
  const draw = {};

  const $ = (id) => document.getElementById(id);
  const color = (run) => COLORS[run % COLORS.length];
  const ENTITIES = { "&": "&amp;", "<": "&lt;", ">": "&gt;" };
  const escapeHtml = (s) => String(s).replace(/[&<>]/g, (c) => ENTITIES[c]);
  const visibleRuns = () => state.runs.filter((r) => !state.hidden.has(r.index) && state.data[r.index]);
  const fmt = (v, digits = 4) => (v === null || v === undefined ? "—" : typeof v === "number" ? +v.toPrecision(digits) : String(v));

  function setEmpty(id, message) {
    const plot = $(id);
    const note = document.querySelector(`.empty[data-for="${id}"]`);
    if (message) {
      if (plot.data) Plotly.purge(plot);
      delete plot.dataset.listening;  // purge removed its listeners: the next draw attaches them again
      plot.style.display = "none";
      note.textContent = message;
      note.hidden = false;
    } else {
      plot.style.display = "";
      note.hidden = true;
    }
    return !message;
  }

  // A horizontal legend at the bottom of the figure (yref "container"), under the x axis's title:
  // plotly reserves its height in the bottom margin however many rows it wraps onto. At a paper y
  // (a fraction of the plot area's height) it landed on the axis title of a short or narrow chart.
  // Charts with it give their x axis automargin: without, plotly lifts the title into the tick labels.
  // A new object each time: plotly keeps the layout it is given and edits it (a dragged legend).
  const legendBelow = (extra) => Object.assign({ orientation: "h", xref: "container", x: 0, xanchor: "left",
    yref: "container", y: 0, yanchor: "bottom", font: { size: 11 } }, extra);

  function baseLayout(extra) {
    return Object.assign({
      margin: { l: 60, r: 20, t: 10, b: 40 }, hovermode: "closest", showlegend: true,
      legend: legendBelow(),
      xaxis: { title: { text: "iteration" }, automargin: true, zeroline: false, range: state.range ? state.range.slice() : undefined, autorange: !state.range },
      yaxis: { zeroline: false, automargin: true },
      // event markers sit on a hidden axis spanning the plot's height
      yaxis9: { overlaying: "y", range: [0, 1], visible: false, fixedrange: true },
      font: { size: 12 }, paper_bgcolor: "#fff", plot_bgcolor: "#fff",
    }, extra);
  }

  function rollbackBands(run) {
    const markers = state.data[run.index].markers;
    return markers.rollbacks.filter((r) => r.to_iter !== null && r.iter !== null).map((r) => ({
      type: "rect", name: `rollback: ${run.name}`, xref: "x", yref: "paper", x0: r.to_iter + 0.5, x1: r.iter + 0.5, y0: 0, y1: 1,
      fillcolor: color(run.index), opacity: 0.12, line: { width: 1, color: color(run.index), dash: "dot" }, layer: "below",
    }));
  }

  // rollback bands as outlines only: over a heatmap a fill would change its colours
  const outlinedBands = (run) => rollbackBands(run).map((b) => Object.assign(b, { fillcolor: "rgba(0,0,0,0)", opacity: 1, layer: "above" }));

  function lineTraces(run, name, opts) {
    const part = state.data[run.index].series.series[name];
    if (!part) return [];
    const c = color(run.index);
    const label = escapeHtml(run.name);
    const hover = `${label}<br>iter %{x}<br>${opts.label} %{y:.5g}<extra></extra>`;
    const traces = [{
      x: part.main.x, y: part.main.y, type: "scatter", mode: opts.mode || "lines", name: opts.legend ? `${label} ${opts.legend}` : label,
      legendgroup: `run${run.index}`, showlegend: opts.showlegend !== false, yaxis: opts.yaxis || "y",
      line: { color: c, width: 1.5, dash: opts.dash || "solid" }, marker: { size: 5, color: c }, hovertemplate: hover,
      meta: { run: run.index, kind: "main", series: name },
    }];
    for (const [kind, points] of [["rollback", part.abandoned], ["superseded", part.superseded]]) {
      if (!points.x.length) continue;
      traces.push({
        x: points.x, y: points.y, type: "scatter", mode: opts.mode || "lines", name: `${label} ${opts.legend || ""} abandoned (${kind})`,
        legendgroup: `run${run.index}`, showlegend: false, yaxis: opts.yaxis || "y", opacity: 0.35, connectgaps: false,
        line: { color: c, width: 1.2, dash: "dot" }, marker: { size: 4, color: c },
        hovertemplate: `${label}<br>abandoned (${kind === "rollback" ? "undone by a rollback" : "superseded by a resume"})<br>iter %{x}<br>${opts.label} %{y:.5g}<extra></extra>`,
        meta: { run: run.index, kind: "abandoned", source: kind, series: name },
      });
    }
    return traces;
  }

  // A skipped step's guard signals, each `<name>` with its `<name>_z` (the server sends them all).
  function signalText(s) {
    return Object.keys(s).filter((k) => k.endsWith("_z")).map((k) => k.slice(0, -2))
      .map((name) => `<br>${name.replace(/_/g, " ")} ${fmt(s[name])} (z ${fmt(s[name + "_z"], 3)})`).join("");
  }

  function markerTraces(run, valueKey) {
    const m = state.data[run.index].markers;
    const c = color(run.index);
    const label = escapeHtml(run.name);
    const traces = [];
    const finite = m.skipped.filter((s) => s[valueKey] !== null);
    const nonfinite = m.skipped.filter((s) => s[valueKey] === null);
    const skipText = (s) => `${label}<br><b>skipped step</b> iter ${s.iter}${s.abandoned ? " (abandoned)" : ""}<br>reason ${escapeHtml(s.reason || "?")}` +
      signalText(s) +
      (s.incident ? "<br><i>click for the incident report</i>" : "");
    if (finite.length) traces.push({
      x: finite.map((s) => s.iter), y: finite.map((s) => s[valueKey]), type: "scatter", mode: "markers", name: `${label} skipped`,
      legendgroup: `run${run.index}`, showlegend: false, marker: { symbol: "x", size: 10, color: "#cf222e", line: { width: 1, color: c } },
      text: finite.map(skipText), hovertemplate: "%{text}<extra></extra>", customdata: finite.map((s) => s.incident),
      meta: { run: run.index, kind: "skip" },
    });
    if (nonfinite.length) traces.push({  // no value to place them at: along the top
      x: nonfinite.map((s) => s.iter), y: nonfinite.map(() => 0.97), yaxis: "y9", type: "scatter", mode: "markers",
      name: `${label} skipped (non-finite)`, legendgroup: `run${run.index}`, showlegend: false,
      marker: { symbol: "x", size: 10, color: "#cf222e" }, text: nonfinite.map(skipText), hovertemplate: "%{text}<extra></extra>",
      customdata: nonfinite.map((s) => s.incident), meta: { run: run.index, kind: "skip" },
    });
    const placed = (items) => items.filter((e) => e.iter !== null && e.iter !== undefined);
    const onTop = (items, y, symbol, fill, kind, text, custom) => {
      if (!items.length) return;
      traces.push({
        x: items.map((e) => e.iter), y: items.map(() => y), yaxis: "y9", type: "scatter", mode: "markers", name: `${label} ${kind}`,
        legendgroup: `run${run.index}`, showlegend: false, marker: { symbol, size: 9, color: fill, line: { width: 1, color: c } },
        text: items.map(text), hovertemplate: "%{text}<extra></extra>", customdata: items.map(custom || (() => null)),
        meta: { run: run.index, kind },
      });
    };
    onTop(m.rollbacks, 0.92, "triangle-down", "#cf222e", "rollback",
      (r) => `${label}<br><b>rollback</b> at iter ${r.iter} to iter ${r.to_iter} (step ${r.from_step} → ${r.to_step})` +
        `<br>iterations ${r.to_iter + 1}..${r.iter} undone<br>LR scale ${fmt(r.lr_scale)}` + (r.incident ? "<br><i>click for the incident report</i>" : ""),
      (r) => r.incident);
    onTop(placed(m.checkpoints), 0.03, "triangle-up", "#0969da", "checkpoint",
      (e) => `${label}<br><b>checkpoint</b> step ${e.step} (iter ${e.iter})<br>${escapeHtml(e.path || "")}`);
    onTop(placed(m.resumes), 0.08, "diamond", "#8250df", "resume",
      (e) => `${label}<br><b>resume</b> from ${escapeHtml(e.checkpoint || "?")}<br>step ${e.step}, iter ${e.iter}`);
    return traces;
  }

  // ---- the time plots --------------------------------------------------------------------

  // The visible runs with train records, and why every iteration plot is empty while none has.
  function trainRuns() {
    const withTrain = visibleRuns().filter((r) => r.records.train + r.records.superseded > 0);
    const waiting = state.runs.length && !withTrain.length;
    return { withTrain, why: waiting ? "Waiting for the run to start: nothing has been written to metrics.jsonl yet." : null };
  }

  draw.timePlots = function () {
    const { withTrain, why } = trainRuns();
    const bands = withTrain.flatMap(rollbackBands);

    if (setEmpty("plot-loss", why)) {
      const traces = withTrain.flatMap((r) => [...lineTraces(r, "loss", { label: "loss" }),
        ...lineTraces(r, "val_loss", { label: "val loss", legend: "val", mode: "lines+markers", dash: "dash" }), ...markerTraces(r, "loss")]);
      react("plot-loss", traces, baseLayout({ shapes: bands, yaxis: { title: { text: "loss" }, automargin: true } }));
    }
    if (setEmpty("plot-grad-norm", why)) {
      const traces = withTrain.flatMap((r) => [...lineTraces(r, "grad_norm", { label: "grad norm" }), ...markerTraces(r, "grad_norm")]);
      react("plot-grad-norm", traces, baseLayout({ shapes: bands, yaxis: { title: { text: "grad norm" }, type: "log", automargin: true } }));
    }
    if (setEmpty("plot-lr", why)) {
      const traces = withTrain.flatMap((r) => [...lineTraces(r, "lr", { label: "lr", legend: "AdamW" }),
        ...lineTraces(r, "lr_muon", { label: "lr Muon", legend: "Muon", dash: "dash" })]).filter((t) => t.y.some((v) => v !== null));
      react("plot-lr", traces, baseLayout({ shapes: bands, yaxis: { title: { text: "learning rate" }, type: "log", exponentformat: "e", automargin: true } }));
    }
    if (setEmpty("plot-throughput", why)) {
      const traces = withTrain.flatMap((r) => [...lineTraces(r, "tokens_per_s", { label: "tokens/s" }),
        ...lineTraces(r, "mfu", { label: "MFU", legend: "MFU", dash: "dot", yaxis: "y2", showlegend: false })]);
      react("plot-throughput", traces, baseLayout({
        shapes: bands, yaxis: { title: { text: "tokens/s" }, automargin: true },
        yaxis2: { title: { text: "MFU" }, overlaying: "y", side: "right", tickformat: ".0%", showgrid: false }, margin: { l: 60, r: 60, t: 10, b: 40 },
      }));
    }
  };

  // The rank x iteration heatmap of compute seconds, host-labelled rows, stragglers starred,
  // the drills outlined on the rows they acted on (every row for a drill of every rank); below
  // it, a line per rank of its exposed communication (seconds blocked in collectives).
  const HEAT_DOMAIN = [0.4, 1], COMM_DOMAIN = [0, 0.3];  // the rank-health panel's two rows
  draw.rankHealth = function () {
    const { why } = trainRuns();
    const focus = state.runs[state.focus];
    const ranks = focus && state.data[focus.index] && state.data[focus.index].ranks;
    const none = "No rank statistics: this run has no \"ranks\" records (every metrics.rank_stats_every iterations; 0 turns them off).";
    if (!setEmpty("plot-ranks", why || (!focus ? "No run." : !ranks || !ranks.ranks.length ? none : null))) return;
    const rows = ranks.ranks.map((r) => `rank ${r}` + (ranks.hosts[r] ? ` · ${escapeHtml(ranks.hosts[r])}` : ""));
    // a report is the mean of the iterations since the one before: its cell spans them
    const x = ranks.x;
    const edges = x.length ? [x[0] - (x.length > 1 ? x[1] - x[0] : x[0]) + 0.5, ...x.map((v) => v + 0.5)] : [];
    const comm = (r) => ranks.comm_exposed_s[r] || x.map(() => null);  // a run recorded before the field: none
    const customdata = ranks.ranks.map((r) => x.map((v, j) => [ranks.iter_s[r][j], ranks.wait_s[r][j], ranks.data_s[r][j], v, comm(r)[j]]));
    const traces = [{
      type: "heatmap", x: edges, y: rows, z: ranks.compute_s, customdata, colorscale: "YlOrRd", reversescale: true, zmin: 0,
      colorbar: { title: { text: "compute s" }, thickness: 12, y: HEAT_DOMAIN[0], yanchor: "bottom", len: HEAT_DOMAIN[1] - HEAT_DOMAIN[0] },
      meta: { run: focus.index, kind: "rank-compute" },
      hovertemplate: "%{y}<br>report at iter %{customdata[3]}<br>compute %{z:.3g} s per iteration<br>iteration %{customdata[0]:.3g} s, " +
        "waiting %{customdata[1]:.3g} s (in collectives %{customdata[4]:.3g} s), data %{customdata[2]:.3g} s<extra></extra>",
    }];
    ranks.ranks.forEach((r) => traces.push({
      x, y: comm(r), type: "scatter", mode: "lines+markers", yaxis: "y2", name: rows[r], marker: { size: 4 },
      line: { width: 1.5 }, meta: { run: focus.index, kind: "rank-comm", rank: r },
      hovertemplate: `${rows[r]}<br>report at iter %{x}<br>exposed communication %{y:.3g} s per iteration<extra></extra>`,
    }));
    const rowOf = (rank) => (rank === null || rank === undefined ? ranks.ranks : [rank]).filter((r) => r < rows.length);
    const drills = ranks.drills.flatMap((d) => rowOf(d.rank).map((r) => Object.assign({ row: r }, d)));
    const drillText = (d) => `<b>drill ${escapeHtml(d.fault)}</b> ${d.rank === null ? "on every rank" : `on rank ${d.rank}`}` +
      `<br>iterations ${d.first}..${d.last}` + (d.seconds ? `<br>${fmt(d.seconds)} s per iteration` : "") + (d.factor ? `<br>factor ${fmt(d.factor)}` : "");
    if (drills.length) traces.push({
      x: drills.map((d) => d.first), y: drills.map((d) => rows[d.row]), type: "scatter", mode: "markers", name: "drill",
      marker: { symbol: "triangle-right", size: 10, color: "#8250df" }, text: drills.map(drillText),
      hovertemplate: "%{text}<extra></extra>", meta: { run: focus.index, kind: "drill" },
    });
    const stragglers = ranks.stragglers.filter((s) => s.rank < rows.length);
    if (stragglers.length) traces.push({
      x: stragglers.map((s) => s.iter), y: stragglers.map((s) => rows[s.rank]), type: "scatter", mode: "markers", name: "straggler",
      marker: { symbol: "star", size: 15, color: "#fff", line: { width: 1.5, color: "#1f2328" } },
      text: stragglers.map((s) => `<b>straggler</b> rank ${s.rank} (${escapeHtml(s.host || "?")}) at iter ${s.iter}` +
        `<br>compute ${fmt(s.compute_s, 3)} s = ${fmt(s.ratio, 3)}× the other ranks' median ${fmt(s.median_s, 3)} s<br>${s.reports} reports in a row`),
      hovertemplate: "%{text}<extra></extra>", meta: { run: focus.index, kind: "straggler" },
    });
    const drillBoxes = drills.map((d) => ({
      type: "rect", name: `drill: ${d.fault}`, xref: "x", yref: "y", x0: d.first - 0.5, x1: d.last + 0.5, y0: d.row - 0.5, y1: d.row + 0.5,
      fillcolor: "rgba(0,0,0,0)", line: { width: 2, color: "#8250df", dash: "dash" }, layer: "above",
    }));
    const layout = baseLayout({ shapes: outlinedBands(focus).concat(drillBoxes),
      yaxis: { title: { text: "rank · host" }, automargin: true, type: "category", autorange: "reversed", domain: HEAT_DOMAIN },
      yaxis2: { title: { text: "comm s" }, automargin: true, rangemode: "tozero", domain: COMM_DOMAIN, anchor: "x", zeroline: false } });
    layout.xaxis.anchor = "y2";  // the shared iteration axis under the lower row
    traces.forEach((t) => { if (t.meta.kind !== "rank-comm") t.showlegend = false; });  // the legend names the lines
    react("plot-ranks", traces, layout);
  };

  draw.expertLoad = function () {
    const { withTrain, why } = trainRuns();
    const focus = state.runs[state.focus];
    const expert = focus && state.data[focus.index] && state.data[focus.index].expert_load;
    const noMoe = "No MoE layers: this run's train records carry no moe_max_load_per_layer.";
    if (setEmpty("plot-moe-heat", why || (!focus ? "No run." : !expert || !expert.z.length ? noMoe : null))) {
      react("plot-moe-heat", [{
        type: "heatmap", x: expert.x, y: expert.layers.map((l) => `layer ${l}`), z: expert.z, colorscale: "YlOrRd", reversescale: true, zmin: 1,
        colorbar: { title: { text: "max / mean" }, thickness: 12 }, hovertemplate: "iter %{x}<br>%{y}<br>max load %{z:.3f}× mean<extra></extra>",
        meta: { run: focus.index, kind: "expert-load" },
      }], baseLayout({ showlegend: false, shapes: outlinedBands(focus),
        yaxis: { title: { text: "MoE layer" }, automargin: true, type: "category" } }));
    }
    const lineRuns = withTrain.filter((r) => state.data[r.index].expert_load.z.length);
    if (setEmpty("plot-moe-lines", why || (!lineRuns.length ? noMoe : null))) {
      const traces = lineRuns.flatMap((r) => {
        const e = state.data[r.index].expert_load;
        return e.z.map((row, j) => ({
          x: e.x, y: row, type: "scatter", mode: "lines", name: `${escapeHtml(r.name)} layer ${e.layers[j]}`, legendgroup: `run${r.index}`,
          line: { color: color(r.index), width: 1.2, dash: DASHES[j % DASHES.length] },
          hovertemplate: `${escapeHtml(r.name)} layer ${e.layers[j]}<br>iter %{x}<br>max load %{y:.3f}× mean<extra></extra>`,
          meta: { run: r.index, kind: "max-load", layer: e.layers[j] },
        }));
      });
      react("plot-moe-lines", traces, baseLayout({ shapes: lineRuns.flatMap(rollbackBands), yaxis: { title: { text: "max / mean" }, automargin: true } }));
    }
  };

  // ---- where the time went ---------------------------------------------------------------

  // One stacked bar per attempt of every visible run and one for its total; a category per colour.
  const GOODPUT_COLORS = { startup: "#9e9e9e", productive: "#2e7d32", undone: "#ef6c00", skipped: "#fbc02d",
    checkpoint: "#1565c0", rollback: "#6a1b9a", validation: "#00838f", statistics: "#8d6e63", data: "#ad1457",
    shutdown: "#bdbdbd", lost: "#c62828" };

  // The bars keep their size however many rows the legend wraps onto (a narrow window): the chart's
  // height is their rows, a frame (margins, axis and its title) and the legend's height as last
  // drawn (one row before the first draw, as on a wide window), refitted after each draw since a
  // resize re-wraps the legend. On the div, not in the layout: a resize of the window drops the
  // layout's height and plotly takes the div's.
  const BAR_PX = 34, FRAME_PX = 100, LEGEND_ROW_PX = 29;
  const legendPx = (div) => (div._fullLayout && div._fullLayout.legend ? div._fullLayout.legend._height : LEGEND_ROW_PX);
  const barsHeight = (div, rows) => `${FRAME_PX + BAR_PX * rows + legendPx(div)}px`;

  function fitGoodputHeight() {
    const div = $("plot-goodput");
    const height = barsHeight(div, div.data[0].y.length);
    if (div.style.height !== height) {
      div.style.height = height;
      Plotly.Plots.resize(div);
    }
  }

  draw.goodput = function () {
    const runs = visibleRuns().filter((r) => state.data[r.index].goodput && state.data[r.index].goodput.attempts.length);
    if (!setEmpty("plot-goodput", !runs.length ? "No time accounted yet: a run writes timeline.jsonl from its first iteration on (runs from before it have none)." : null)) return;
    const rows = runs.flatMap((r) => {
      const g = state.data[r.index].goodput;
      const total = { label: `${escapeHtml(r.name)} total (goodput ${(100 * g.goodput).toFixed(1)}%)`, seconds: g.seconds, wall: g.wall_s };
      return [total, ...g.attempts.map((a) => ({ label: `${escapeHtml(r.name)} #${a.attempt} ${escapeHtml(a.host)}${a.status ? "" : " (killed)"}`,
        seconds: a.seconds, wall: a.wall_s + a.lost_before_s }))];
    });
    const { categories, labels } = state.data[runs[0].index].goodput;
    const traces = categories.map((c) => ({
      type: "bar", orientation: "h", name: labels[c], y: rows.map((row) => row.label), x: rows.map((row) => row.seconds[c] || 0),
      marker: { color: GOODPUT_COLORS[c] }, customdata: rows.map((row) => (row.wall > 0 ? (100 * (row.seconds[c] || 0)) / row.wall : 0)),
      hovertemplate: `%{y}<br>${labels[c]}: %{x:.1f} s (%{customdata:.1f}% of its wall)<extra></extra>`, meta: { kind: "goodput", category: c },
    }));
    $("plot-goodput").style.height = barsHeight($("plot-goodput"), rows.length);
    react("plot-goodput", traces, { barmode: "stack", margin: { l: 20, r: 20, t: 10, b: 40 },
      xaxis: { title: { text: "seconds" }, automargin: true }, yaxis: { automargin: true, autorange: "reversed", type: "category" },
      // maxheight 1: all of the legend, which the height makes room for (plotly scrolls one past half of it)
      legend: legendBelow({ traceorder: "normal", maxheight: 1 }), font: { size: 12 } });
  };

  // ---- the layer plots -------------------------------------------------------------------

  draw.layers = async function () {
    const focus = state.runs[state.focus];
    const steps = focus && state.data[focus.index] ? state.data[focus.index].layer_steps.iters : [];
    const slider = $("layer-step");
    slider.max = Math.max(steps.length - 1, 0);
    const at = state.layerIter === null ? -1 : steps.indexOf(state.layerIter);
    slider.value = at < 0 ? slider.max : at;
    const iter = steps.length ? steps[+slider.value] : null;
    const runs = visibleRuns();
    const records = await Promise.all(runs.map((r) => source.layerRecord(r.index, iter)));
    const have = runs.map((r, i) => [r, records[i]]).filter(([, rec]) => rec.iter !== null);
    const abandonedNote = (rec) => (rec.abandoned ? " (abandoned)" : "");
    const focusRecord = have.find(([r]) => r.index === (focus && focus.index));
    $("layer-step-label").textContent = focusRecord ? `iter ${focusRecord[1].iter}, step ${focusRecord[1].step}${abandonedNote(focusRecord[1])}` : "";
    const why = !state.runs.length || !have.length
      ? "No layer statistics: no run has written a \"layers\" record yet (they come every metrics.layer_stats_every steps; 0 turns them off)." : null;

    const rec = focusRecord && focusRecord[1];
    const experts = rec ? rec.tokens_per_expert_relative : [];
    if (setEmpty("plot-experts", why || (!rec ? "No layer statistics in the selected run." : !experts.length ? "No MoE layers in the selected run." : null))) {
      react("plot-experts", [{
        type: "heatmap", z: experts, x: experts[0].map((_, j) => `${j}`), y: rec.moe_layers.map((l) => `layer ${l}`),
        colorscale: "RdBu", reversescale: true, zmid: 1, colorbar: { title: { text: "÷ mean" }, thickness: 12 },
        hovertemplate: "%{y}, expert %{x}<br>%{z:.3f}× the layer's mean<extra></extra>", meta: { run: focus.index, kind: "experts" },
      }], { margin: { l: 70, r: 20, t: 10, b: 40 }, xaxis: { title: { text: "expert" }, type: "category" },
        yaxis: { title: { text: "MoE layer" }, type: "category", automargin: true }, font: { size: 12 } });
    }
    const depth = (id, traces, title) => {
      if (setEmpty(id, why)) react(id, traces, { margin: { l: 60, r: 20, t: 10, b: 40 }, hovermode: "closest", legend: legendBelow(),
        xaxis: { title: { text: "layer" }, automargin: true, dtick: 1 }, yaxis: { title: { text: title }, automargin: true }, font: { size: 12 } });
    };
    const profile = (r, record, key, dash, what) => ({
      x: record[key].map((_, i) => i), y: record[key], type: "scatter", mode: "lines+markers", name: `${escapeHtml(r.name)} ${what}`,
      line: { color: color(r.index), dash }, marker: { size: 6 }, legendgroup: `run${r.index}`,
      hovertemplate: `${escapeHtml(r.name)} ${what}<br>iter ${record.iter}${abandonedNote(record)}<br>layer %{x}: %{y:.4g}<extra></extra>`,
      meta: { run: r.index, kind: key },
    });
    depth("plot-depth-grad", have.flatMap(([r, record]) => [profile(r, record, "grad_norm_attn", "solid", "attention"),
      profile(r, record, "grad_norm_ffn", "dash", "FFN")]), "grad norm");
    depth("plot-depth-rms", have.map(([r, record]) => profile(r, record, "residual_rms", "solid", "residual RMS")), "RMS");
  };

  // ---- long-context evaluation -----------------------------------------------------------

  // One colour per position bucket (the later, the darker), one dash per run.
  const BUCKET_COLORS = ["#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c", "#08306b", "#54278f", "#3f007d", "#67000d", "#a50f15"];
  const bucketLabel = (starts, j) => (j + 1 < starts.length ? `positions [${starts[j]}, ${starts[j + 1]})` : `positions ≥ ${starts[j]}`);

  // The loss of each position bucket over iterations (the iterations a rollback undid left out),
  // and the passkey probes by prompt length: the run's first probe faded, its latest solid.
  draw.longContext = function (panel) {
    const runs = visibleRuns().filter((r) => state.data[r.index][panel.name]);
    const ofRun = (r) => state.data[r.index][panel.name];
    const withBuckets = runs.filter((r) => ofRun(r).positions.starts.length);
    const noBuckets = "No validation loss by position: no run has a val record with val_loss_by_position (runs before the long-context evaluation).";
    if (setEmpty("plot-position-loss", !withBuckets.length ? noBuckets : null)) {
      const traces = withBuckets.flatMap((r, k) => {
        const p = ofRun(r).positions;
        const label = escapeHtml(r.name);
        return p.starts.map((start, j) => ({
          x: p.iters, y: p.loss[j].map((v, i) => (p.abandoned[i] ? null : v)), type: "scatter", mode: "lines+markers",
          name: `${label} ${bucketLabel(p.starts, j)}`, legendgroup: `run${r.index}`, connectgaps: true,
          line: { color: BUCKET_COLORS[j % BUCKET_COLORS.length], width: 1.5, dash: DASHES[k % DASHES.length] }, marker: { size: 4 },
          hovertemplate: `${label}<br>${bucketLabel(p.starts, j)}<br>iter %{x}<br>val loss %{y:.4g}<extra></extra>`,
          meta: { run: r.index, kind: "position-loss", start },
        }));
      });
      react("plot-position-loss", traces, baseLayout({ shapes: withBuckets.flatMap(rollbackBands), yaxis: { title: { text: "val loss" }, automargin: true } }));
    }
    const withProbes = runs.filter((r) => ofRun(r).passkey.iters.length);
    const noProbes = "No passkey probes: a run probes at validation every eval.passkey_every steps (0, the default, turns it off).";
    if (!setEmpty("plot-passkey", !withProbes.length ? noProbes : null)) return;
    const lengths = new Set();
    const traces = withProbes.flatMap((r) => {
      const pk = ofRun(r).passkey;
      pk.lengths.forEach((n) => lengths.add(n));
      const kept = pk.iters.map((_, i) => i).filter((i) => !pk.abandoned[i]);
      const shown = [...new Set([kept[0], kept[kept.length - 1]])].filter((i) => i !== undefined);
      return shown.flatMap((i, n) => {
        const latest = n === shown.length - 1;
        const label = `${escapeHtml(r.name)} iter ${pk.iters[i]}`;
        const common = { x: pk.lengths, type: "scatter", mode: "lines+markers", legendgroup: `run${r.index}`, opacity: latest ? 1 : 0.35, marker: { size: 6 } };
        // A key log-likelihood line on the right axis: the probe's own, or its control's.
        const keyLine = (values, what, hover, dash, kind) => Object.assign({}, common, { y: values.map((row) => row[i]), yaxis: "y2",
          name: `${label} ${what}`, line: { color: color(r.index), width: 1.5, dash },
          hovertemplate: `${label}<br>length %{x}<br>${hover} %{y:.3f} nats per token<extra></extra>`,
          meta: { run: r.index, kind, iter: pk.iters[i] } });
        const lines = [
          Object.assign({}, common, { y: pk.accuracy.map((row) => row[i]), name: `${label} retrieved`, line: { color: color(r.index), width: 2 },
            hovertemplate: `${label}<br>length %{x}<br>retrieved %{y:.0%}<extra></extra>`, meta: { run: r.index, kind: "passkey-accuracy", iter: pk.iters[i] } }),
          keyLine(pk.logprob, "key log-likelihood", "key log-likelihood", "dash", "passkey-logprob"),
        ];
        // The control (the same key scored in prompts hiding another one): what the model guesses
        // without the needle; older runs' probes have none.
        if (pk.logprob_other_key.some((row) => row[i] !== null)) {
          lines.push(keyLine(pk.logprob_other_key, "key log-likelihood, another key hidden",
            "another key hidden: key log-likelihood", "dot", "passkey-logprob-other-key"));
        }
        return lines;
      });
    });
    const ticks = [...lengths].sort((a, b) => a - b);
    react("plot-passkey", traces, { margin: { l: 60, r: 60, t: 10, b: 40 }, hovermode: "closest", showlegend: true,
      legend: legendBelow(), font: { size: 12 }, paper_bgcolor: "#fff", plot_bgcolor: "#fff",
      xaxis: { title: { text: "prompt length (tokens)" }, automargin: true, type: "log", tickvals: ticks, ticktext: ticks.map(String) },
      yaxis: { title: { text: "retrieved" }, range: [-0.05, 1.05], tickformat: ".0%", zeroline: false },
      yaxis2: { title: { text: "key log-likelihood" }, overlaying: "y", side: "right", showgrid: false, zeroline: false } });
  };

  function react(id, traces, layout) {
    const div = $(id);
    Plotly.react(div, traces, layout, CONFIG);
    if (!div.dataset.listening) {  // plotly adds .on() to a div once it has drawn into it
      div.dataset.listening = "true";
      div.on("plotly_click", onClick);
      if (TIME_PLOTS.includes(id)) div.on("plotly_relayout", onRelayout);
      if (id === "plot-goodput") div.on("plotly_afterplot", fitGoodputHeight);
    }
  }

  // ---- incident reports ------------------------------------------------------------------

  function element(tag, text, attrs) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = text;
    Object.assign(e, attrs || {});
    return e;
  }

  async function showIncident(run, name) {
    const body = $("incident-body");
    body.replaceChildren(element("p", "loading…"));
    $("incident").hidden = false;
    let report;
    try {
      report = await source.incident(run, name);
    } catch (err) {
      body.replaceChildren(element("p", `No incident report: ${err.message}`));
      return;
    }
    const title = report.action === "rollback" ? `Rollback at iteration ${report.iter}` : `Skipped step at iteration ${report.iter}`;
    const parts = [element("h2", title), element("p", `${state.runs[run].name} · step ${report.step} · reason: ${report.reason}`)];
    if (Array.isArray(report.signals) && report.signals.length) {
      const table = element("table");
      const keys = Object.keys(report.signals[0]).filter((k) => k !== "step");  // the guard's signals, as written
      table.appendChild(element("tr")).append(...keys.map((k) => element("th", k)));
      for (const s of report.signals) {
        const row = table.appendChild(element("tr", null, { className: s.skipped ? "flagged" : "" }));
        row.append(...keys.map((k) => element("td", fmt(s[k], 5))));
      }
      parts.push(element("h3", "Signals around it"), table);
    }
    if (report.rollback) parts.push(element("h3", "Rollback"), element("pre", JSON.stringify(report.rollback, null, 1)));
    if (report.layer_grad_norms) parts.push(element("h3", "Gradient norm by layer"), element("pre", JSON.stringify(report.layer_grad_norms)));
    if (Array.isArray(report.batches)) parts.push(element("h3", "Batches and their documents"), element("pre", JSON.stringify(report.batches, null, 1)));
    body.replaceChildren(...parts);
  }

  function onClick(event) {
    const point = event.points && event.points[0];
    const meta = point && point.data.meta;
    if (meta && (meta.kind === "skip" || meta.kind === "rollback") && point.customdata) showIncident(meta.run, point.customdata);
  }

  // ---- loading and refreshing ------------------------------------------------------------

  function plotWidth() {
    return Math.max(200, Math.round($("plot-loss").clientWidth || document.body.clientWidth / 2));
  }

  async function loadRun(run) {
    const [x0, x1] = state.range || [null, null];
    const range = { x0, x1, width: plotWidth() };
    const payloads = await Promise.all(state.panels.map((panel) => source.panel(run, panel, range)));
    state.data[run] = Object.fromEntries(state.panels.map((panel, i) => [panel.name, payloads[i]]));
  }

  async function drawPanels() {
    for (const panel of state.panels.filter((p) => p.draw)) {
      if (draw[panel.draw]) await draw[panel.draw](panel);
      else console.warn(`dashboard.js has no draw.${panel.draw} for the panel ${panel.name}`);
    }
  }

  // A panel index.html has no place for gets a section of its own, one plot, at the end.
  function addSlot(panel) {
    if (!panel.slot || $(panel.slot)) return;
    const section = element("section");
    const holder = element("div", null, { className: "panel" });
    holder.append(element("h2", panel.name), element("div", null, { id: panel.slot, className: "plot" }),
      element("p", null, { className: "empty", hidden: true }));
    holder.lastChild.dataset.for = panel.slot;
    section.append(holder);
    document.querySelector("main").append(section);
  }

  let pending = null;
  let queued = new Set();
  function scheduleRefresh(runs) {
    runs.forEach((r) => queued.add(r));
    if (pending) return;
    pending = setTimeout(async () => {
      const todo = [...queued];
      queued = new Set();
      try {
        await refresh(todo);
      } finally {
        pending = null;
        if (queued.size) scheduleRefresh([]);
      }
    }, 200);
  }

  async function refresh(runIndices) {
    state.runs = await source.runs();
    await Promise.all(runIndices.map(loadRun));
    renderRunLegend();
    await drawPanels();
    if (!state.rendered && TIME_PLOTS.concat(LAYER_PLOTS).some((id) => $(id).data)) {
      state.rendered = true;
      window.dashboardRenderedAt = performance.now();  // read by the benchmark and the tests
      document.body.dataset.rendered = "true";
    }
  }

  function renderRunLegend() {
    const holder = $("runs");
    holder.replaceChildren(...state.runs.map((r) => {
      const chip = element("span", null, { className: "chip" });
      chip.style.background = color(r.index);
      const states = { waiting: "waiting for the run to start", running: `running, iter ${r.last_iter}`,
        ended: `ended at iter ${r.last_iter}`, halted: `halted at iter ${r.last_iter}` };
      const label = element("span", null, { className: `run${state.hidden.has(r.index) ? " hidden" : ""}`, title: "show or hide this run" });
      label.append(chip, element("b", r.name), element("span", r.loaded === false ? "loading…" : states[r.state] || r.state, { className: "state" }));
      label.addEventListener("click", () => {
        if (state.hidden.has(r.index)) state.hidden.delete(r.index); else state.hidden.add(r.index);
        renderRunLegend();
        drawPanels();
      });
      return label;
    }));
    const select = $("focus-run");
    if (select.options.length !== state.runs.length) {
      select.replaceChildren(...state.runs.map((r) => element("option", r.name, { value: r.index })));
      select.value = state.focus;
    }
    const waiting = state.runs.filter((r) => r.state === "waiting");
    $("waiting").hidden = !waiting.length;
    $("waiting").textContent = waiting.length ? `Waiting for the run to start: ${waiting.map((r) => r.name).join(", ")} (the page picks it up when it appears).` : "";
  }

  // Zooming one time plot zooms them all and, live, fetches the visible range at full resolution.
  let syncing = false;
  function onRelayout(event) {
    if (syncing) return;
    let range;
    if (event["xaxis.autorange"]) range = null;
    else if (event["xaxis.range[0]"] !== undefined) range = [event["xaxis.range[0]"], event["xaxis.range[1]"]];
    else if (Array.isArray(event["xaxis.range"])) range = event["xaxis.range"].slice();
    else return;
    state.range = range;
    syncing = true;
    Promise.all(TIME_PLOTS.filter((id) => $(id).data).map((id) => Plotly.relayout($(id), range ? { "xaxis.range": range } : { "xaxis.autorange": true })))
      .finally(() => { syncing = false; });
    if (source.live) scheduleRefresh(state.runs.map((r) => r.index));
  }

  function connect() {
    const status = $("connection");
    const events = new EventSource("api/stream");
    events.addEventListener("open", () => { status.textContent = "live"; status.className = "connection live"; });
    events.addEventListener("error", () => { status.textContent = "reconnecting…"; status.className = "connection lost"; });
    events.addEventListener("hello", (e) => scheduleRefresh(JSON.parse(e.data).runs.map((r) => r.index)));
    events.addEventListener("reset", (e) => { delete state.data[JSON.parse(e.data).run]; });
    events.addEventListener("update", (e) => scheduleRefresh([JSON.parse(e.data).run]));
  }

  async function start() {
    if (SNAPSHOT) {
      $("title").textContent = SNAPSHOT.title;
      $("connection").textContent = `report written ${SNAPSHOT.written}`;
    }
    $("incident-close").addEventListener("click", () => { $("incident").hidden = true; });
    $("focus-run").addEventListener("change", (e) => { state.focus = +e.target.value; drawPanels(); });
    $("layer-step").addEventListener("input", (e) => {
      const focus = state.runs[state.focus];
      const steps = state.data[focus.index].layer_steps.iters;
      // at the right end the slider follows the newest step as the run goes on
      state.layerIter = +e.target.value === steps.length - 1 ? null : steps[+e.target.value];
      draw.layers();
    });
    state.panels = await source.panels();
    state.panels.forEach(addSlot);
    state.runs = await source.runs();
    await refresh(state.runs.map((r) => r.index));
    if (source.live) connect();
  }

  window.dashboardState = state;  // for the browser tests and for poking at in the console
  window.dashboardDraw = draw;    // the same, and a test's panel brings its draw function here
  start();
})();
