def render_all(out, page):
    return []
