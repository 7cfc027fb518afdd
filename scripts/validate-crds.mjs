// Validates custom resources against their CRD's schema: scripts/check_deploy.py hands over a JSON
// list of objects. The schemas come from the npm package @kubernetes-models/prometheus-operator
// (generated from prometheus-operator's CRDs), installed by scripts/check-deploy.sh.
// What this checks: types, required fields, enums, patterns. What it does NOT check: unknown
// fields (the generated schemas allow them; the API server would prune or, with strict field
// validation, refuse them).
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";

const [models, file] = process.argv.slice(2);
const pkg = `${models}/node_modules/@kubernetes-models/prometheus-operator`;
const version = JSON.parse(readFileSync(`${pkg}/package.json`, "utf8")).version;
const kinds = {
  "monitoring.coreos.com/v1 ServiceMonitor": "monitoring.coreos.com/v1/ServiceMonitor.js",
};
let bad = 0;
for (const obj of JSON.parse(readFileSync(file, "utf8"))) {
  const key = `${obj.apiVersion} ${obj.kind}`;
  const path = kinds[key];
  if (!path) {
    console.log(`${key} ${obj.metadata.name}: no schema known here`);
    bad++;
    continue;
  }
  const mod = await import(pathToFileURL(`${pkg}/${path}`).href);
  try {
    new mod[obj.kind](obj).validate();
    console.log(`${key} ${obj.metadata.name}: valid (@kubernetes-models/prometheus-operator ${version}; unknown fields not checked)`);
  } catch (e) {
    console.log(`${key} ${obj.metadata.name}: ${e.message}`);
    bad++;
  }
}
process.exit(bad ? 1 : 0);
