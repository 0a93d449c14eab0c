"""A small shop on 127.0.0.1 for the browser environment (tasks/envs/builtin/browser.py): WebArena's shopping site, cut
down to what a task set needs. Products with prices, stock and sizes, categories, a search, a cart, a checkout
form and the orders placed. Each browser session (a cookie) has its own cart and orders, so concurrent episodes
never see each other's.

    python -m tasks.envs.builtin.webshop --port 8765                  # serve it (Ctrl-C stops)
    python -m tasks.envs.builtin.webshop --tasks > shop_tasks.jsonl   # the task set, a row per task, checkers included
    python -m tasks.envs.builtin.webshop --tasks --split held-out     # the tasks never in training (HELD_OUT)
    python -m tasks.envs.builtin.webshop --tasks --split train --pool 200   # + 200 generated training orders

    with serve() as url: ...                                          # in a thread on a free port (tests, benchmarks)

Every task row has a `prompt` (the intent), a `start` path and a `check` (browser.py: the checkers): an answer
to match, or pages of the shop that must show what the task asked for once the episode ends (an order placed).
"""

from __future__ import annotations

import argparse
import html
import itertools
import json
import random
import re
import secrets
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route


@dataclass(frozen=True)
class Product:
    slug: str
    name: str
    category: str
    price: float
    stock: int
    sizes: tuple[str, ...] = ()
    about: str = ""


CATALOG = (
    Product("blue-kettle", "Blue Kettle", "Kitchen", 24.99, 7, (), "A 1.5 litre enamel kettle for gas and induction."),
    Product("steel-pan", "Steel Pan", "Kitchen", 31.50, 12, ("20 cm", "24 cm", "28 cm"),
            "Carbon steel; season before use."),
    Product("oak-board", "Oak Cutting Board", "Kitchen", 18.00, 4, (), "End-grain oak, oiled."),
    Product("tea-tin", "Tea Tin", "Kitchen", 6.25, 30, (), "Holds 200 g of loose tea."),
    Product("rain-jacket", "Rain Jacket", "Clothing", 89.00, 3, ("S", "M", "L", "XL"),
            "Taped seams, packs into its pocket."),
    Product("wool-socks", "Wool Socks", "Clothing", 12.40, 25, ("S", "M", "L"), "Merino blend, two pairs."),
    Product("linen-shirt", "Linen Shirt", "Clothing", 45.00, 9, ("S", "M", "L"), "Washed linen, relaxed fit."),
    Product("desk-lamp", "Desk Lamp", "Home", 39.90, 6, (), "Warm LED, dimmable, USB-C."),
    Product("wool-blanket", "Wool Blanket", "Home", 74.00, 2, (), "150 x 200 cm, undyed wool."),
    Product("clay-vase", "Clay Vase", "Home", 22.75, 11, (), "Hand thrown, 25 cm tall."),
    Product("notebook", "Dot Notebook", "Office", 9.80, 40, (), "A5, 160 pages, dotted."),
    Product("fountain-pen", "Fountain Pen", "Office", 28.00, 8, ("Fine", "Medium"), "Steel nib, converter included."),
)
BY_SLUG = {p.slug: p for p in CATALOG}
CATEGORIES = sorted({p.category for p in CATALOG})
SHIPPING = {"Standard": 4.50, "Express": 12.00}
COOKIE = "shop_session"


@dataclass
class Session:
    cart: list[dict] = field(default_factory=list)        # {"slug", "size", "qty"}
    orders: list[dict] = field(default_factory=list)


def money(x: float) -> str:
    return f"${x:.2f}"


def _page(title: str, body: str, cart: int = 0) -> str:
    return (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)} - Corner Shop"
            f"</title></head><body><header><nav aria-label='Main'><a href='/'>Home</a> <a href='/cart'>Cart ({cart})"
            f"</a> <a href='/orders'>My orders</a></nav></header><main>{body}</main></body></html>")


def _product_list(products: list[Product]) -> str:
    items = "".join(f"<li><a href='/product/{p.slug}'>{html.escape(p.name)}</a> {money(p.price)}</li>"
                    for p in products)
    return f"<ul>{items}</ul>"


def app() -> Starlette:
    sessions: dict[str, Session] = {}
    lock = threading.Lock()

    def session(request: Request) -> tuple[str, Session]:
        sid = request.cookies.get(COOKIE, "")
        with lock:
            if sid not in sessions:
                sid = secrets.token_hex(8)
                sessions[sid] = Session()
            return sid, sessions[sid]

    def respond(request: Request, title: str, body: str, status: int = 200) -> Response:
        sid, s = session(request)
        out = HTMLResponse(_page(title, body, sum(i["qty"] for i in s.cart)), status_code=status)
        out.set_cookie(COOKIE, sid, httponly=True, samesite="lax")
        return out

    def redirect(request: Request, to: str) -> Response:
        sid, _ = session(request)
        out = RedirectResponse(to, status_code=303)
        out.set_cookie(COOKIE, sid, httponly=True, samesite="lax")
        return out

    async def home(request: Request) -> Response:
        cats = "".join(f"<li><a href='/category/{c}'>{c}</a></li>" for c in CATEGORIES)
        body = ("<h1>Corner Shop</h1><form action='/search' method='get' role='search'><label for='q'>Search products"
                "</label> <input id='q' name='q' type='search'> <button type='submit'>Search</button></form>"
                f"<h2>Categories</h2><ul>{cats}</ul><h2>All products</h2>{_product_list(list(CATALOG))}")
        return respond(request, "Home", body)

    async def search(request: Request) -> Response:
        q = request.query_params.get("q", "").strip()
        found = [p for p in CATALOG if q and (q.lower() in p.name.lower() or q.lower() in p.about.lower())]
        body = (f"<h1>Results for \"{html.escape(q)}\"</h1><p>{len(found)} product"
                f"{'' if len(found) == 1 else 's'} found</p>{_product_list(found)}")
        return respond(request, "Search", body)

    async def category(request: Request) -> Response:
        name = request.path_params["name"]
        found = [p for p in CATALOG if p.category == name]
        if not found:
            return respond(request, "Not found", "<h1>No such category</h1>", 404)
        return respond(request, name, f"<h1>{name}</h1>{_product_list(found)}")

    async def product(request: Request) -> Response:
        p = BY_SLUG.get(request.path_params["slug"])
        if p is None:
            return respond(request, "Not found", "<h1>No such product</h1>", 404)
        sizes = ""
        if p.sizes:
            options = "".join(f"<option>{s}</option>" for s in p.sizes)
            sizes = f"<p><label for='size'>Size</label> <select id='size' name='size'>{options}</select></p>"
        body = (f"<h1>{html.escape(p.name)}</h1><p>Price: {money(p.price)}</p><p>In stock: {p.stock}</p>"
                f"<p>{html.escape(p.about)}</p><p>Category: <a href='/category/{p.category}'>{p.category}</a></p>"
                f"<form action='/cart/add' method='post'><input type='hidden' name='slug' value='{p.slug}'>{sizes}"
                f"<p><label for='qty'>Quantity</label> <input id='qty' name='qty' type='number' min='1' "
                f"max='{p.stock}' value='1'></p><button type='submit'>Add to cart</button></form>")
        return respond(request, p.name, body)

    async def cart_add(request: Request) -> Response:
        form = await request.form()
        p = BY_SLUG.get(str(form.get("slug", "")))
        try:
            qty = int(str(form.get("qty", "1")))
        except ValueError:
            qty = 0
        if p is None:
            return respond(request, "Not found", "<h1>No such product</h1>", 404)
        size = str(form.get("size", "")) if p.sizes else ""
        if not 1 <= qty <= p.stock or (p.sizes and size not in p.sizes):
            return respond(request, "Cannot add", f"<h1>Cannot add to cart</h1><p>Choose a quantity from 1 to "
                           f"{p.stock}{' and a size' if p.sizes else ''}.</p><a href='/product/{p.slug}'>Back</a>", 400)
        _, s = session(request)
        s.cart.append({"slug": p.slug, "size": size, "qty": qty})
        return redirect(request, "/cart")

    def _line(item: dict) -> str:
        p = BY_SLUG[item["slug"]]
        return f"{item['qty']} x {p.name}" + (f" (size {item['size']})" if item["size"] else "")

    async def cart(request: Request) -> Response:
        _, s = session(request)
        if not s.cart:
            return respond(request, "Cart", "<h1>Your cart</h1><p>Your cart is empty.</p>")
        rows = "".join(f"<tr><td>{html.escape(_line(i))}</td><td>{money(i['qty'] * BY_SLUG[i['slug']].price)}</td></tr>"
                       for i in s.cart)
        ship = "".join(f"<option value='{k}'>{k} ({money(v)})</option>" for k, v in SHIPPING.items())
        body = (f"<h1>Your cart</h1><table><thead><tr><th>Item</th><th>Price</th></tr></thead><tbody>{rows}</tbody>"
                f"</table><h2>Checkout</h2><form action='/checkout' method='post'><p><label for='name'>Full name"
                f"</label> <input id='name' name='name' required></p><p><label for='address'>Address</label> "
                f"<input id='address' name='address' required></p><p><label for='shipping'>Shipping</label> "
                f"<select id='shipping' name='shipping'>{ship}</select></p><button type='submit'>Place order"
                f"</button></form>")
        return respond(request, "Cart", body)

    async def checkout(request: Request) -> Response:
        form = await request.form()
        _, s = session(request)
        name, address = str(form.get("name", "")).strip(), str(form.get("address", "")).strip()
        shipping = str(form.get("shipping", "Standard"))
        if not s.cart or not name or not address or shipping not in SHIPPING:
            return respond(request, "Cannot order", "<h1>Cannot place the order</h1><p>A cart with items, a name "
                           "and an address are needed.</p><a href='/cart'>Back to the cart</a>", 400)
        total = sum(i["qty"] * BY_SLUG[i["slug"]].price for i in s.cart) + SHIPPING[shipping]
        s.orders.append({"lines": [_line(i) for i in s.cart], "name": name, "address": address,
                         "shipping": shipping, "total": total})
        s.cart = []
        return redirect(request, f"/orders/{len(s.orders)}")

    async def orders(request: Request) -> Response:
        _, s = session(request)
        items = "".join(f"<li><a href='/orders/{n}'>Order #{n}</a> {money(o['total'])}</li>"
                        for n, o in enumerate(s.orders, 1))
        listed = f"<ul>{items}</ul>" if items else "<p>No orders yet.</p>"
        return respond(request, "My orders", f"<h1>My orders</h1>{listed}")

    async def order(request: Request) -> Response:
        _, s = session(request)
        n = request.path_params["n"]
        if n == "last" and s.orders:
            n = str(len(s.orders))
        if not n.isdigit() or not 1 <= int(n) <= len(s.orders):
            return respond(request, "Not found", "<h1>No such order</h1>", 404)
        o = s.orders[int(n) - 1]
        lines = "".join(f"<li>{html.escape(line)}</li>" for line in o["lines"])
        body = (f"<h1>Order #{n}</h1><p>Thank you for your order.</p><ul>{lines}</ul>"
                f"<p>Ship to: {html.escape(o['name'])}, {html.escape(o['address'])}</p>"
                f"<p>Shipping: {o['shipping']}</p><p>Total: {money(o['total'])}</p>")
        return respond(request, f"Order #{n}", body)

    return Starlette(routes=[
        Route("/", home), Route("/search", search), Route("/category/{name}", category),
        Route("/product/{slug}", product), Route("/cart/add", cart_add, methods=["POST"]), Route("/cart", cart),
        Route("/checkout", checkout, methods=["POST"]), Route("/orders", orders), Route("/orders/{n}", order)])


# ------------------------------------------------------------------------------------------ the task set

# Held out of training (configs/data/shop_heldout.jsonl): tasks on these products (their price, stock and order),
# these searches and this category are never in the training split (shop_train.jsonl), nor the people its orders
# ship to. The training split shows every skill the held-out tasks need on other instances: orders of 1-4 items,
# with and without a size, both shippings; searches for words of a name and of a description; both ends of a
# category's prices (an answer read off the page, not one remembered).
HELD_OUT = {"products": ("tea-tin", "wool-socks", "desk-lamp"), "searches": ("steel", "usb"),
            "categories": ("Office",)}
SEARCHES = ("wool", "linen", "pen", "oak", "cm", "season", "nib", "pocket", "steel", "usb")
ORDERS = (("blue-kettle", 1, "", "Standard"), ("steel-pan", 2, "28 cm", "Express"), ("oak-board", 3, "", "Standard"),
          ("rain-jacket", 1, "L", "Express"), ("linen-shirt", 3, "S", "Express"), ("wool-blanket", 2, "", "Standard"),
          ("clay-vase", 4, "", "Express"), ("notebook", 2, "", "Standard"), ("fountain-pen", 1, "Medium", "Express"),
          ("wool-socks", 2, "M", "Express"), ("tea-tin", 4, "", "Express"), ("desk-lamp", 3, "", "Standard"))
PEOPLE = {"train": (("Ada Lovelace", "12 Elm Street"), ("Alan Turing", "3 Bletchley Road"),
                    ("Grace Hopper", "9 Navy Way"), ("Edsger Dijkstra", "40 Path Lane"),
                    ("Barbara Liskov", "8 Clu Court")),
          "held-out": (("Katherine Johnson", "7 Orbit Lane"), ("Hedy Lamarr", "5 Signal Street"),
                       ("Claude Shannon", "21 Bit Avenue"))}


def shop_tasks(split: str = "all") -> list[dict]:
    """WebArena-style tasks on this shop, each with its checker (tasks/envs/builtin/browser.py: check) and its
    `split` (train, or held-out: HELD_OUT); `split` picks one (all: every task)."""
    rows: list[dict] = []

    def add(kind: str, prompt: str, check: dict, held: bool = False) -> None:
        rows.append(_row(kind, prompt, check, "held-out" if held else "train"))

    for p in CATALOG:
        held = p.slug in HELD_OUT["products"]
        add("price", f"What does the {p.name} cost? Answer with the number only.",
            {"answer": {"exact": f"{p.price:.2f}"}}, held=held)
        add("stock", f"How many {p.name} items are in stock? Answer with the number only.",
            {"answer": {"exact": str(p.stock)}}, held=held)
    for term in SEARCHES:
        n = sum(term in p.name.lower() or term in p.about.lower() for p in CATALOG)
        add("search", f'How many products does a search for "{term}" find? Answer with the number only.',
            {"answer": {"exact": str(n)}}, held=term in HELD_OUT["searches"])
    for c in CATEGORIES:
        products = sorted((p for p in CATALOG if p.category == c), key=lambda p: p.price)
        for kind, end in (("cheapest", products[0]), ("most expensive", products[-1])):
            add(kind, f"Which product in the {c} category is the {kind}? Answer with its name.",
                {"answer": {"must_include": [end.name.lower()]}}, held=c in HELD_OUT["categories"])
    customers = {side: itertools.cycle(people) for side, people in PEOPLE.items()}    # each split's, in turn
    for slug, qty, size, shipping in ORDERS:
        side = "held-out" if slug in HELD_OUT["products"] else "train"
        rows.append(_order(slug, qty, size, shipping, *next(customers[side]), side))
    return rows if split == "all" else [r for r in rows if r["split"] == split]


def _row(kind: str, prompt: str, check: dict, split: str) -> dict:
    return {"prompt": prompt, "start": "/", "kind": kind, "check": check, "split": split}


def _order(slug: str, qty: int, size: str, shipping: str, name: str, address: str, split: str) -> dict:
    p = BY_SLUG[slug]
    what = f"{qty} {p.name}" + (f" in size {size}" if size else "")
    line = f"{qty} x {p.name}" + (f" (size {size})" if size else "")
    return _row("order", f"Order {what} with {shipping} shipping for {name}, {address}. Say done when it is placed.",
                {"pages": [{"url": "/orders/last", "must_include": [line, f"Ship to: {name}, {address}",
                                                                   f"Shipping: {shipping}"]}]}, split)


FIRST = ("Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "Frances", "John", "Margaret", "Niklaus", "Radia",
         "Tim", "Sophie", "Ken", "Leslie", "Shafi")
LAST = ("Knuth", "Allen", "Backus", "Hamilton", "Wirth", "Perlman", "Berners-Lee", "Wilson", "Thompson", "Lamport",
        "Goldwasser", "Ritchie", "Hoare", "Kay", "Milner", "Floyd")
STREETS = ("Elm Street", "Mill Road", "Harbour Way", "Station Lane", "Oak Court", "Bridge Street", "Park Avenue")


def order_pool(n: int, seed: int = 0) -> list[dict]:
    """`n` more training orders, drawn at `seed`: a training product, 1-4 items (its stock permitting), a size
    where it has sizes, either shipping, a customer and address made from lists the held-out customers' names
    and streets are not in: a warm start on many sees more orders than shop_tasks' 9 (`--tasks --pool N`)."""
    rng = random.Random(seed)
    products = [p for p in CATALOG if p.slug not in HELD_OUT["products"]]
    rows = []
    for _ in range(n):
        p, name = rng.choice(products), f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        rows.append(_order(p.slug, rng.randint(1, min(4, p.stock)), rng.choice(p.sizes) if p.sizes else "",
                           rng.choice(sorted(SHIPPING)), name, f"{rng.randint(1, 99)} {rng.choice(STREETS)}", "train"))
    return rows


def reference_action(context: str, tool_call: bool = False) -> str:
    """The next action of a policy that solves every task of shop_tasks() from what the model sees (the task, and
    the page as browser.py renders it, last in the context): the task set's proof of being solvable, and the
    benchmark's policy. As text (`click [12]`), or as a Hermes tool call."""
    task = re.search(r"Task: (.*)", context).group(1)
    page = context[context.rindex("Page: "):].splitlines()

    def ref(pattern: str, last: bool = False) -> str:
        line = next(line for line in (page[::-1] if last else page) if re.search(pattern, line))
        return re.match(r"\s*\[(\d+)\]", line).group(1)

    heading = next((m.group(1) for line in page if (m := re.search(r"heading '(.*)' level: 1", line))), "")

    def value(pattern: str) -> str:
        line = next((line for line in page if re.search(pattern, line)), "")
        found = re.search(r"value: '([^']*)'", line)
        return found.group(1) if found else ""

    def find(name: str) -> tuple[str, dict]:      # a product's page by searching its name: the same actions for
        if heading == f'Results for "{name}"':    # every product (the search box and the one hit keep their numbers)
            return "click", {"ref": ref(f"link '{re.escape(name)}'")}
        if not any("searchbox" in line for line in page):
            return "click", {"ref": ref("link 'Home'")}
        return "type", {"ref": ref("searchbox"), "text": name, "submit": True}

    def act() -> tuple[str, dict]:
        if m := re.match(r"What does the (.+) cost\?|How many (.+) items are in stock\?", task):
            name = m.group(1) or m.group(2)
            if heading != name:
                return find(name)
            what = r"Price: \$([\d.]+)" if m.group(1) else r"In stock: (\d+)"
            return "answer", {"text": next(x.group(1) for line in page if (x := re.search(what, line)))}
        if m := re.match(r'How many products does a search for "(.+)" find', task):
            if heading.startswith("Results for"):
                hits = next(x.group(1) for line in page if (x := re.search(r"'(\d+) products? found", line)))
                return "answer", {"text": hits}
            return "type", {"ref": ref("searchbox"), "text": m.group(1), "submit": True}
        if m := re.match(r"Which product in the (\w+) category is the (cheapest|most expensive)", task):
            if heading != m.group(1):
                return "click", {"ref": ref(f"link '{m.group(1)}'", last=True)}    # (not the menu's Home)
            names = [x.group(1) for line in page if (x := re.search(r"link '(.*)'", line))]
            prices = [float(x.group(1)) for line in page if (x := re.search(r"StaticText '\$([\d.]+)'", line))]
            end = min if m.group(2) == "cheapest" else max
            return "answer", {"text": end(zip(prices, names[-len(prices):]))[1]}
        m = re.match(r"Order (\d+) (.+?)(?: in size (.+?))? with (\w+) shipping for ([^,]+), (.+)\. Say done", task)
        qty, name, size, shipping, person, address = m.groups()
        if heading.startswith("Order #"):
            return "answer", {"text": "done"}
        if heading == "Your cart":
            for field, want in (("Full name", person), ("Address", address)):
                if value(f"textbox '{field}'") != want:
                    return "type", {"ref": ref(f"textbox '{field}'"), "text": want}
            if not value("combobox 'Shipping'").startswith(shipping):
                option = next(x.group(1) for line in page if (x := re.search(rf"option '({shipping} .*)'", line)))
                return "select", {"ref": ref("combobox 'Shipping'"), "option": option}
            return "click", {"ref": ref("button 'Place order'")}
        if heading != name:
            return find(name)
        if value("spinbutton 'Quantity'") != qty:
            return "type", {"ref": ref("spinbutton 'Quantity'"), "text": qty}
        if size and value("combobox 'Size'") != size:
            return "select", {"ref": ref("combobox 'Size'"), "option": size}
        return "click", {"ref": ref("button 'Add to cart'")}

    verb, args = act()
    if tool_call:
        args = {k: int(v) if k == "ref" else v for k, v in args.items()}
        return "<tool_call>" + json.dumps({"name": verb, "arguments": args}) + "</tool_call>"
    from tasks.envs.builtin.browser import written

    return written(verb, args)                  # (the browser's text syntax; imported here: the site needs none)


def reference_tool_calls(context: str) -> str:
    """reference_action as Hermes tool calls (`rlflow record --policy` for a model whose template declares tools)."""
    return reference_action(context, tool_call=True)


# ------------------------------------------------------------------------------------------ serving

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(port: int = 0) -> Iterator[str]:
    """The shop in a thread of this process on 127.0.0.1 (a free port by default): its base URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app(), host="127.0.0.1", port=port or free_port(), log_level="warning",
                                           access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True, name="webshop")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the shop did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tasks.envs.builtin.webshop", description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--tasks", action="store_true", help="print the task set as JSON lines and exit")
    ap.add_argument("--split", choices=["all", "train", "held-out"], default="all", help="with --tasks: which")
    ap.add_argument("--pool", type=int, default=0, metavar="N",
                    help="with --tasks: N generated training orders after the set (order_pool)")
    ap.add_argument("--seed", type=int, default=0, help="with --pool: the draw's seed")
    args = ap.parse_args(argv)
    if args.pool < 0 or (args.pool and (not args.tasks or args.split == "held-out")):
        ap.error(f"--pool {args.pool}: N >= 0 generated training orders, with --tasks and --split train or all")
    if args.tasks:
        rows = shop_tasks(args.split) + order_pool(args.pool, args.seed)
        sys.stdout.write("".join(json.dumps(row) + "\n" for row in rows))
        return 0
    import uvicorn

    print(f"the shop: http://127.0.0.1:{args.port}", flush=True)
    uvicorn.run(app(), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
