// The playground page: model picker, settings, the conversation and the keyboard (Enter sends,
// Shift+Enter adds a line, Escape stops), and the live metrics panel.

import { LivePanel } from "./metrics.js";
import { Answer } from "./stream.js";

const $ = (selector) => document.querySelector(selector);
const history = [];
let controller = null;
let modelRetry = null; // the timer of the next model listing while the server isn't ready

function authHeaders() {
  const key = $("#api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// Asks again in `seconds` (a server still loading its model says when in Retry-After).
function retryModels(seconds) {
  clearTimeout(modelRetry);
  modelRetry = setTimeout(loadModels, 1000 * Math.min(Math.max(seconds, 0.5), 10));
}

async function loadModels() {
  clearTimeout(modelRetry);
  const status = $("#model-status");
  try {
    const response = await fetch("/v1/models", { headers: authHeaders() });
    const body = await response.json();
    if (!response.ok) {
      status.textContent = response.status === 401
        ? "this server needs an API key: enter it in the settings" : body.error.message;
      if (response.status === 503) retryModels(Number(response.headers.get("Retry-After")) || 1);
      return;
    }
    const select = $("#model");
    const chosen = select.value;
    select.replaceChildren(...body.data.map((card) => new Option(card.id, card.id)));
    if (body.data.some((card) => card.id === chosen)) select.value = chosen;
    status.textContent = body.data.length > 1 ? `${body.data.length} models` : "";
  } catch (error) {
    status.textContent = `cannot list models (${error.message})`;
    retryModels(2); // a server restarting, or a proxy's error page: the listing comes once it is back
  }
}

function number(selector) {
  // An empty field is left out of the request: the server's default (the model's recommended one) applies.
  const text = $(selector).value.trim();
  const value = Number(text);
  return text && Number.isFinite(value) ? value : undefined;
}

function addMessage(role, text) {
  const article = document.createElement("article");
  article.className = `message ${role}`;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  article.append(label, content);
  $("#messages").append(article);
  return article;
}

function setBusy(busy) {
  $("#send").disabled = busy;
  $("#stop").disabled = !busy;
}

async function send() {
  const text = $("#prompt").value;
  if (!text.trim() || controller) return;
  $("#prompt").value = "";
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const article = $("#answer-template").content.firstElementChild.cloneNode(true);
  $("#messages").append(article);
  $("#messages").scrollTop = $("#messages").scrollHeight; // the question just sent, and its answer below
  const system = $("#system").value.trim();
  const body = {
    model: $("#model").value || undefined,
    messages: system ? [{ role: "system", content: system }, ...history] : [...history],
    temperature: number("#temperature"), top_p: number("#top-p"), max_tokens: number("#max-tokens"),
  };
  controller = new AbortController();
  setBusy(true);
  const answer = new Answer(article);
  const reply = await answer.run(body, authHeaders(), controller.signal);
  controller = null;
  setBusy(false);
  if (reply) history.push({ role: "assistant", content: reply });
  else history.pop(); // nothing came back: the question leaves the conversation too
  $("#messages").scrollTop = $("#messages").scrollHeight;
  $("#prompt").focus();
}

function stop() {
  if (controller) controller.abort();
}

function init() {
  const key = $("#api-key");
  key.value = sessionStorage.getItem("vivace-api-key") || "";
  key.addEventListener("change", () => {
    sessionStorage.setItem("vivace-api-key", key.value.trim());
    loadModels();
  });
  $("#composer").addEventListener("submit", (event) => { event.preventDefault(); send(); });
  $("#stop").addEventListener("click", stop);
  $("#clear").addEventListener("click", () => { history.length = 0; $("#messages").replaceChildren(); });
  $("#prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (event) => { if (event.key === "Escape") stop(); });
  loadModels();
  new LivePanel(document.body).start();
  $("#prompt").focus();
}

init();
