// Page-wide htmx behaviour: signed-out polls go to the sign-in page, a poll
// never replaces a form someone is typing in, and a <details> the reader opened
// or closed stays so.
(function () {
  "use strict";

  // settings.LOGIN_URL, written by templates/base.html as <body data-login-url>.
  function loginPath() {
    return (document.body && document.body.dataset.loginUrl) || "/login/";
  }

  // The whole tab to the sign-in page, coming back to this page (not to a fragment) after.
  function signIn() {
    const here = window.location.pathname + window.location.search + window.location.hash;
    // Encoded as the server's HX-Redirect encodes it (Django keeps "/" as is), so both give one URL.
    window.location.assign(loginPath() + "?next=" + encodeURIComponent(here).replace(/%2F/g, "/"));
  }
  window.kvcpSignIn = signIn;

  // The server answers a signed-out htmx request with 401 and HX-Redirect, which
  // htmx follows before any swap (cacheadmin/middleware.py). This is the fallback
  // for a response that still ended on the sign-in page (a redirect followed
  // inside the XMLHttpRequest, e.g. behind a proxy that drops HX-* headers): never
  // swap the sign-in form into a section.
  function landedOnLogin(xhr) {
    const url = (xhr && xhr.responseURL) || "";
    if (!url) return false;
    try {
      return new URL(url, window.location.href).pathname === loginPath();
    } catch (error) {
      return false;
    }
  }

  // True while the user is editing inside `root`: a field or button of a form in it
  // has focus, or a field's value differs from what the server rendered.
  function editing(root) {
    const active = document.activeElement;
    if (active && active !== document.body && root.contains(active) && active.closest("form")) return true;
    for (const field of root.querySelectorAll("input, textarea, select")) {
      if (field.type === "hidden") continue;
      if (field.type === "checkbox" || field.type === "radio") {
        if (field.checked !== field.defaultChecked) return true;
      } else if (field.tagName === "SELECT") {
        for (const option of field.options) if (option.selected !== option.defaultSelected) return true;
      } else if (field.value !== field.defaultValue) {
        return true;
      }
    }
    return false;
  }

  document.addEventListener("htmx:beforeSwap", (event) => {
    const detail = event.detail;
    if (landedOnLogin(detail.xhr)) {
      detail.shouldSwap = false;
      signIn();
      return;
    }
    // Only reads (polls) wait: a form submitted through htmx must still get its answer.
    const verb = ((detail.requestConfig && detail.requestConfig.verb) || "get").toLowerCase();
    if (verb === "get" && detail.shouldSwap && detail.target && editing(detail.target)) {
      // Keep what is typed; the element keeps its hx-trigger, so the next poll tries again.
      detail.shouldSwap = false;
      detail.target.dataset.swapSkippedAt = new Date().toISOString();
    }
    if (detail.shouldSwap && detail.target) rememberDetails(detail.target);
  });

  // A poll renders each <details> open or closed as served (a deceptive hit's answers open);
  // one the reader opened or closed keeps that state across the swap, found again by its id.
  // Entries wait for the element that replaces theirs (sections of a page swap independently).
  const detailsOpen = new Map();
  function rememberDetails(root) {
    for (const element of root.querySelectorAll("details[id]")) detailsOpen.set(element.id, { element, open: element.open });
  }
  document.addEventListener("htmx:afterSettle", () => {
    for (const [id, { element, open }] of detailsOpen) {
      const now = document.getElementById(id);
      if (now === element) continue; // not swapped yet
      if (now && now.tagName === "DETAILS") now.open = open;
      detailsOpen.delete(id);
    }
  });
})();
