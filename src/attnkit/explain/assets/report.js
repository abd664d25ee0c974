
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("attnkit-data").textContent);
  var sections = data.sections;
  var sectionSelect = document.getElementById("section-select");
  var layerSelect = document.getElementById("layer-select");
  var headSelect = document.getElementById("head-select");
  var showNumbers = document.getElementById("show-numbers");
  var grid = document.getElementById("attention-grid");
  var details = document.getElementById("row-details");
  var info = document.getElementById("section-info");
  var legend = document.getElementById("grid-legend");
  var current = null;  // {section, rows: [[w]], max}

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
  function fillSelect(select, labels, values) {
    select.replaceChildren();
    for (var i = 0; i < labels.length; i++) select.appendChild(new Option(labels[i], values[i]));
  }
  function matrix(sec, layer, head) {
    var H = sec.shape[1], N = sec.shape[2], M = sec.shape[3], w = sec.weights, rows = [];
    for (var i = 0; i < N; i++) {
      var row = [];
      for (var j = 0; j < M; j++) {
        if (head === "mean") {
          var sum = 0;
          for (var h = 0; h < H; h++) sum += w[((layer * H + h) * N + i) * M + j];
          row.push(sum / H);
        } else {
          row.push(w[((layer * H + head) * N + i) * M + j]);
        }
      }
      rows.push(row);
    }
    return rows;
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
    for (var h = 0; h < sec.shape[1]; h++) { heads.push("head " + h); headValues.push(String(h)); }
    heads.push("mean of heads"); headValues.push("mean");
    fillSelect(headSelect, heads, headValues);
    layerSelect.value = String(clamp(state.layer, sec.shape[0]));
    headSelect.value = state.head === "mean" ? "mean" : String(clamp(state.head, sec.shape[1]));
    draw();
  }
  function selected() {
    var head = headSelect.value === "mean" ? "mean" : parseInt(headSelect.value, 10);
    return {section: parseInt(sectionSelect.value, 10),
            layer: parseInt(layerSelect.value, 10), head: head};
  }
  function draw() {
    var state = selected();
    var sec = sections[state.section];
    var rows = matrix(sec, state.layer, state.head);
    var max = 0;
    rows.forEach(function (row) { row.forEach(function (w) { if (w > max) max = w; }); });
    current = {section: sec, rows: rows, max: max};
    var hash = "#section=" + state.section + "&layer=" + state.layer + "&head=" + state.head;
    if (location.hash !== hash) history.replaceState(null, "", hash);
    info.textContent = sec.name + ": " + sec.shape[0] + " layers, " + sec.shape[1] + " heads, " +
      sec.shape[2] + " queries \u00d7 " + sec.shape[3] + " keys" +
      (sec.description ? ". " + sec.description : "");
    var M = sec.shape[3];
    grid.style.setProperty("--cell", Math.max(10, Math.min(30, Math.floor(720 / M))) + "px");
    var numbers = showNumbers.checked;
    grid.replaceChildren();
    var head = el("tr");
    head.appendChild(el("th", "corner", "query \\ key"));
    sec.key_tokens.forEach(function (token, j) {
      var th = el("th", "key", shown(token));
      th.setAttribute("data-col", String(j));
      th.title = token;
      head.appendChild(th);
    });
    grid.appendChild(head);
    rows.forEach(function (row, i) {
      var tr = el("tr");
      tr.setAttribute("data-row", String(i));
      var th = el("th", "query", shown(sec.query_tokens[i]));
      th.tabIndex = 0;
      th.title = sec.query_tokens[i];
      tr.appendChild(th);
      row.forEach(function (w, j) {
        var td = el("td");
        var alpha = max > 0 ? Math.max(0, w) / max : 0;
        td.style.backgroundColor = "rgba(47, 111, 179, " + alpha.toFixed(3) + ")";
        td.style.color = alpha > 0.55 ? "#fff" : "#222";
        td.setAttribute("data-col", String(j));
        td.setAttribute("data-weight", w.toFixed(4));
        td.title = sec.query_tokens[i] + " \u2192 " + sec.key_tokens[j] + ": " + w.toFixed(4);
        if (numbers) td.textContent = w.toFixed(2).replace(/^0\./, ".");
        tr.appendChild(td);
      });
      grid.appendChild(tr);
    });
    legend.textContent = "Colour: weight / " + max.toFixed(4) +
      " (the largest weight shown). Each row sums to 1 (0 for a query that may attend to nothing).";
    showRow(null);
  }
  function showRow(i, col) {
    grid.querySelectorAll(".active").forEach(function (node) { node.classList.remove("active"); });
    details.replaceChildren();
    if (i === null || current === null) {
      details.appendChild(el("p", "hint", "Hover a query token (a row) to see its weights."));
      return;
    }
    var sec = current.section, row = current.rows[i];
    var tr = grid.querySelector('tr[data-row="' + i + '"]');
    if (tr) tr.classList.add("active");
    if (col !== undefined) {
      var key = grid.querySelector('th.key[data-col="' + col + '"]');
      if (key) key.classList.add("active");
    }
    var title = el("h2");
    title.appendChild(document.createTextNode("query " + i + ": "));
    title.appendChild(el("span", "token", shown(sec.query_tokens[i])));
    details.appendChild(title);
    var table = el("table");
    table.id = "row-weights";
    var total = 0;
    row.forEach(function (w, j) {
      total += w;
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
  grid.addEventListener("mouseover", function (event) {
    var tr = event.target.closest("tr[data-row]");
    if (!tr) return;
    var cell = event.target.closest("td");
    var col = cell ? cell.getAttribute("data-col") : undefined;
    showRow(parseInt(tr.getAttribute("data-row"), 10), col === null ? undefined : col);
  });
  grid.addEventListener("focusin", function (event) {
    var tr = event.target.closest("tr[data-row]");
    if (tr) showRow(parseInt(tr.getAttribute("data-row"), 10));
  });
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
})();
