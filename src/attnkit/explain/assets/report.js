
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("attnkit-data").textContent);
  var sections = data.sections;
  var sectionSelect = document.getElementById("section-select");
  var layerSelect = document.getElementById("layer-select");
  var headSelect = document.getElementById("head-select");
  var showNumbers = document.getElementById("show-numbers");
  var grid = document.getElementById("attention-grid");      // the weights, drawn on a canvas
  var overlay = document.getElementById("grid-overlay");     // the hovered row and cell
  var details = document.getElementById("row-details");
  var info = document.getElementById("section-info");
  var legend = document.getElementById("grid-legend");
  var modelView = document.getElementById("model-grid");
  var LISTED = 64;       // a row longer than this lists its largest weights only
  var current = null;    // {section, values: Float32Array(N * M), max, layout}

  function el(tag, className, text) {
    var node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function shown(token) {  // whitespace made visible, never empty
    if (token === "") return "\u2205";
    if (token.trim() === "") return "\u2423".repeat(token.length);
    return token;
  }
  function cut(text, n) { return text.length <= n ? text : text.slice(0, n - 1) + "\u2026"; }
  function fillSelect(select, labels, values) {
    select.replaceChildren();
    for (var i = 0; i < labels.length; i++) select.appendChild(new Option(labels[i], values[i]));
  }

  // The weights of a section: float JSON (short inputs), or bytes in base64 with one scale per
  // (layer, head) matrix (long inputs): weight = byte / 255 * scale.
  function decoded(sec) {
    if (sec.values) return sec.values;
    if (sec.encoding === "u8") {
      var raw = atob(sec.data), bytes = new Uint8Array(raw.length);
      for (var k = 0; k < raw.length; k++) bytes[k] = raw.charCodeAt(k);
      sec.values = {bytes: bytes, scales: sec.scales};
      sec.data = null;
    } else {
      sec.values = {floats: Float32Array.from(sec.weights)};
      sec.weights = null;
    }
    return sec.values;
  }
  function matrix(sec, layer, head) {  // Float32Array(N * M): one head, or the mean of heads
    var H = sec.shape[1], NM = sec.shape[2] * sec.shape[3], v = decoded(sec);
    var out = new Float32Array(NM), heads = head === "mean" ? H : 1;
    for (var hh = 0; hh < heads; hh++) {
      var h = head === "mean" ? hh : head, base = (layer * H + h) * NM;
      if (v.floats) {
        for (var k = 0; k < NM; k++) out[k] += v.floats[base + k];
      } else {
        var f = v.scales[layer * H + h] / 255;
        for (var q = 0; q < NM; q++) out[q] += v.bytes[base + q] * f;
      }
    }
    if (heads > 1) for (var m = 0; m < NM; m++) out[m] /= heads;
    return out;
  }

  function readHash() {
    var state = {section: 0, layer: 0, head: 0};
    var params = new URLSearchParams(location.hash.replace(/^#/, ""));
    ["section", "layer"].forEach(function (key) {
      var value = parseInt(params.get(key), 10);
      if (!isNaN(value)) state[key] = value;
    });
    var head = params.get("head");
    if (head === "mean") state.head = "mean";
    else if (head !== null && !isNaN(parseInt(head, 10))) state.head = parseInt(head, 10);
    return state;
  }
  function clamp(value, n) { return Math.min(Math.max(value, 0), n - 1); }
  function apply(state) {
    var s = clamp(state.section, sections.length);
    sectionSelect.value = String(s);
    var sec = sections[s];
    var layers = [], heads = [], headValues = [];
    for (var l = 0; l < sec.shape[0]; l++) layers.push(String(l));
    fillSelect(layerSelect, layers.map(function (l) { return "layer " + l; }), layers);
    if (!sec.heads_averaged) {
      for (var h = 0; h < sec.shape[1]; h++) { heads.push("head " + h); headValues.push(String(h)); }
    }
    heads.push("mean of heads"); headValues.push("mean");
    fillSelect(headSelect, heads, headValues);
    layerSelect.value = String(clamp(state.layer, sec.shape[0]));
    headSelect.value = state.head === "mean" || sec.heads_averaged ? "mean"
      : String(clamp(state.head, sec.shape[1]));
    draw();
    drawModelView(sec);
  }
  function selected() {
    var head = headSelect.value === "mean" ? "mean" : parseInt(headSelect.value, 10);
    return {section: parseInt(sectionSelect.value, 10),
            layer: parseInt(layerSelect.value, 10), head: head};
  }

  // One matrix as pixels: one pixel per weight, white to blue by weight / max.
  function image(values, n, m, max) {
    var picture = new ImageData(m, n), px = picture.data;
    for (var k = 0; k < n * m; k++) {
      var a = max > 0 ? Math.max(0, values[k]) / max : 0;
      px[4 * k] = Math.round(255 - a * 208);
      px[4 * k + 1] = Math.round(255 - a * 144);
      px[4 * k + 2] = Math.round(255 - a * 76);
      px[4 * k + 3] = 255;
    }
    return picture;
  }
  function draw() {
    var t0 = performance.now();
    var state = selected();
    var sec = sections[state.section];
    var N = sec.shape[2], M = sec.shape[3];
    var values = matrix(sec, state.layer, state.head);
    var max = 0;
    for (var k = 0; k < values.length; k++) if (values[k] > max) max = values[k];
    var hash = "#section=" + state.section + "&layer=" + state.layer + "&head=" + state.head;
    if (location.hash !== hash) history.replaceState(null, "", hash);
    info.textContent = sec.name + ": " + sec.shape[0] + " layers, " +
      (sec.heads_averaged ? "heads averaged" : sec.shape[1] + " heads") + ", " +
      N + " queries \u00d7 " + M + " keys" + (sec.description ? ". " + sec.description : "");
    var cell = Math.max(1, Math.min(30, Math.floor(720 / Math.max(N, M))));
    var labels = cell >= 8;  // room for the tokens beside the rows and above the columns
    var ctx = grid.getContext("2d");
    ctx.font = "13px system-ui, sans-serif";
    var left = 0, top = 0;
    if (labels) {
      sec.query_tokens.forEach(function (t) {
        left = Math.max(left, ctx.measureText(cut(shown(t), 16)).width);
      });
      sec.key_tokens.forEach(function (t) {
        top = Math.max(top, ctx.measureText(cut(shown(t), 16)).width);
      });
      left = Math.ceil(left) + 8; top = Math.ceil(top) + 8;
    }
    grid.width = overlay.width = left + cell * M;
    grid.height = overlay.height = top + cell * N;
    ctx = grid.getContext("2d");
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, grid.width, grid.height);
    var pixels = document.createElement("canvas");
    pixels.width = M; pixels.height = N;
    pixels.getContext("2d").putImageData(image(values, N, M, max), 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(pixels, left, top, cell * M, cell * N);
    ctx.font = "13px system-ui, sans-serif";
    ctx.fillStyle = "#1d1d1f";
    if (labels) {
      ctx.textAlign = "right"; ctx.textBaseline = "middle";
      sec.query_tokens.forEach(function (t, i) {
        ctx.fillText(cut(shown(t), 16), left - 4, top + (i + 0.5) * cell);
      });
      ctx.save();
      ctx.rotate(-Math.PI / 2);
      ctx.textAlign = "left";
      sec.key_tokens.forEach(function (t, j) {
        ctx.fillText(cut(shown(t), 16), -top + 4, left + (j + 0.5) * cell);
      });
      ctx.restore();
    }
    if (showNumbers.checked && cell >= 22) {
      ctx.font = "10px system-ui, sans-serif";
      ctx.textAlign = "center"; ctx.textBaseline = "middle";
      for (var i = 0; i < N; i++) {
        for (var j = 0; j < M; j++) {
          var w = values[i * M + j];
          ctx.fillStyle = max > 0 && w / max > 0.55 ? "#fff" : "#222";
          ctx.fillText(w.toFixed(2).replace(/^0\./, "."), left + (j + 0.5) * cell,
                       top + (i + 0.5) * cell);
        }
      }
    }
    grid.dataset.left = String(left); grid.dataset.top = String(top);
    grid.dataset.cell = String(cell); grid.dataset.max = String(max);
    grid.dataset.rows = String(N); grid.dataset.cols = String(M);
    current = {section: sec, values: values, max: max, left: left, top: top, cell: cell};
    legend.textContent = "Colour: weight / " + max.toFixed(4) + " (the largest weight shown). " +
      "Each row sums to 1 (0 for a query that may attend to nothing)." +
      (sec.encoding === "u8" ? " Weights are stored to 1/255 of each matrix's largest." : "");
    showRow(null);
    document.body.dataset.drawMs = (performance.now() - t0).toFixed(1);
  }

  // The model view: every layer x head as a thumbnail (as bertviz's model view); a click
  // opens that one above.
  function drawModelView(sec) {
    if (!modelView) return;
    modelView.replaceChildren();
    var L = sec.shape[0], H = sec.shape[1], N = sec.shape[2], M = sec.shape[3];
    var size = Math.min(64, Math.max(N, M));
    var sn = Math.min(N, size), sm = Math.min(M, size);
    var table = el("table");
    var head = el("tr");
    head.appendChild(el("th", "", ""));
    for (var h = 0; h < H; h++) head.appendChild(el("th", "", sec.heads_averaged ? "mean" : "h" + h));
    table.appendChild(head);
    for (var l = 0; l < L; l++) {
      var tr = el("tr");
      tr.appendChild(el("th", "", "layer " + l));
      for (var hh = 0; hh < H; hh++) {
        var values = matrix(sec, l, sec.heads_averaged ? "mean" : hh);
        var sampled = new Float32Array(sn * sm), max = 0;
        for (var i = 0; i < sn; i++) {
          for (var j = 0; j < sm; j++) {
            var v = values[Math.floor(i * N / sn) * M + Math.floor(j * M / sm)];
            sampled[i * sm + j] = v;
            if (v > max) max = v;
          }
        }
        var thumb = document.createElement("canvas");
        thumb.width = sm; thumb.height = sn;
        thumb.className = "thumb";
        thumb.title = "layer " + l + (sec.heads_averaged ? ", mean of heads" : ", head " + hh);
        thumb.getContext("2d").putImageData(image(sampled, sn, sm, max), 0, 0);
        thumb.dataset.layer = String(l);
        thumb.dataset.head = sec.heads_averaged ? "mean" : String(hh);
        var td = el("td");
        td.appendChild(thumb);
        tr.appendChild(td);
      }
      table.appendChild(tr);
    }
    modelView.appendChild(table);
  }

  function where(event) {  // the (row, column) under the pointer, or null
    if (!current) return null;
    var box = grid.getBoundingClientRect();
    var x = (event.clientX - box.left) * grid.width / box.width - current.left;
    var y = (event.clientY - box.top) * grid.height / box.height - current.top;
    var i = Math.floor(y / current.cell), j = Math.floor(x / current.cell);
    var N = current.section.shape[2], M = current.section.shape[3];
    if (y < 0 && x >= 0 && j < M) return {row: null, col: j};
    if (x < 0 && y >= 0 && i < N) return {row: i, col: null};
    if (i < 0 || j < 0 || i >= N || j >= M) return null;
    return {row: i, col: j};
  }
  function highlight(i, j) {
    var ctx = overlay.getContext("2d");
    ctx.clearRect(0, 0, overlay.width, overlay.height);
    if (!current || i === null) return;
    var c = current.cell, M = current.section.shape[3];
    ctx.strokeStyle = "#d29b00"; ctx.lineWidth = Math.max(1, Math.min(2, c / 4));
    ctx.strokeRect(current.left, current.top + i * c, c * M, c);
    if (j !== null && j !== undefined) {
      ctx.strokeStyle = "#b4002d";
      ctx.strokeRect(current.left + j * c, current.top + i * c, c, c);
    }
  }
  function showRow(i, col) {
    highlight(i, col);
    details.replaceChildren();
    if (i === null || current === null) {
      details.appendChild(el("p", "hint", "Hover a row of the grid to see its weights."));
      return;
    }
    details.dataset.row = String(i);
    var sec = current.section, M = sec.shape[3];
    var row = current.values.subarray(i * M, (i + 1) * M);
    var title = el("h2");
    title.appendChild(document.createTextNode("query " + i + ": "));
    title.appendChild(el("span", "token", shown(sec.query_tokens[i])));
    details.appendChild(title);
    if (col !== null && col !== undefined) {
      var cellNote = el("p", "cell");
      cellNote.appendChild(document.createTextNode("key " + col + ": "));
      cellNote.appendChild(el("span", "token", shown(sec.key_tokens[col])));
      cellNote.appendChild(document.createTextNode(" \u2190 " + row[col].toFixed(4)));
      details.appendChild(cellNote);
    }
    var order = [];
    for (var j = 0; j < M; j++) order.push(j);
    if (M > LISTED) {
      order.sort(function (a, b) { return row[b] - row[a]; });
      order = order.slice(0, 20);
      details.appendChild(el("p", "legend", "the 20 largest of " + M + " weights:"));
    }
    var table = el("table");
    table.id = "row-weights";
    var total = 0;
    for (var k = 0; k < M; k++) total += row[k];
    order.forEach(function (j) {
      var w = row[j];
      var tr = el("tr");
      tr.appendChild(el("td", "key", shown(sec.key_tokens[j])));
      var barCell = el("td", "bar-cell");
      var bar = el("div", "bar");
      bar.style.width = (current.max > 0 ? 100 * Math.max(0, w) / current.max : 0) + "%";
      barCell.appendChild(bar);
      tr.appendChild(barCell);
      tr.appendChild(el("td", "weight", w.toFixed(4)));
      table.appendChild(tr);
    });
    details.appendChild(table);
    details.appendChild(el("p", "legend", "sum of the row: " + total.toFixed(4)));
  }
  grid.addEventListener("mousemove", function (event) {
    var at = where(event);
    if (at && at.row !== null) showRow(at.row, at.col);
  });
  grid.addEventListener("keydown", function (event) {  // the arrows walk the rows
    if (!current) return;
    var N = current.section.shape[2];
    var now = details.dataset.row ? parseInt(details.dataset.row, 10) : -1;
    var next = event.key === "ArrowDown" ? now + 1 : event.key === "ArrowUp" ? now - 1 : null;
    if (next === null) return;
    event.preventDefault();
    showRow(clamp(next, N));
  });
  if (modelView) {
    modelView.addEventListener("click", function (event) {
      var thumb = event.target.closest("canvas.thumb");
      if (!thumb) return;
      layerSelect.value = thumb.dataset.layer;
      headSelect.value = thumb.dataset.head;
      draw();
      grid.scrollIntoView({block: "nearest"});
    });
  }
  sectionSelect.addEventListener("change", function () {
    apply({section: parseInt(sectionSelect.value, 10), layer: 0, head: 0});
  });
  layerSelect.addEventListener("change", draw);
  headSelect.addEventListener("change", draw);
  showNumbers.addEventListener("change", draw);
  window.addEventListener("hashchange", function () { apply(readHash()); });
  if (sections.length === 0) return;
  fillSelect(sectionSelect, sections.map(function (s) { return s.name; }),
             sections.map(function (s, i) { return String(i); }));
  apply(readHash());
  document.body.dataset.readyMs = performance.now().toFixed(0);  // since the page was asked for
})();
