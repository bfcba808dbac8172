// A poll that lands on the login page (expired session) reloads the whole
// page there instead of swapping the login form into a table.
document.addEventListener("htmx:beforeSwap", (event) => {
  const url = event.detail.xhr.responseURL || "";
  if (url.includes("/admin/login/")) {
    event.detail.shouldSwap = false;
    window.location.href = url;
  }
});
